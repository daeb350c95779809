"""A router Ray restarted after a crash resumes itself (router/server.py _resume_itself, resume):
its call to itself is retried while Ray answers that the actor is still restarting, and a second
resume call joins the first instead of starting the router twice."""

from __future__ import annotations

import asyncio

import pytest
import ray
import ray.exceptions

from pdcluster.router import server


class FakeSelf:
    """The actor handle `ray.get_runtime_context().current_actor` gives: `resume.remote()` calls."""

    def __init__(self, unavailable: int):
        self.unavailable, self.calls = unavailable, 0
        self.resume = self

    def remote(self):
        self.calls += 1
        return self.calls


@pytest.fixture
def fake_ray(monkeypatch):
    def install(unavailable: int) -> FakeSelf:
        me = FakeSelf(unavailable)

        class Context:
            current_actor = me

        def get(ref):
            if ref <= me.unavailable:
                raise ray.exceptions.ActorUnavailableError("The actor is restarting", None)
            return "http://router"

        monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(server.time, "sleep", lambda s: None)
        return me
    return install


def test_a_call_refused_while_the_actor_restarts_is_made_again(fake_ray):
    me = fake_ray(unavailable=3)
    server._resume_itself()
    assert me.calls == 4  # three answered "restarting", the fourth taken


def test_it_gives_up_after_its_bound(fake_ray, monkeypatch, caplog):
    me = fake_ray(unavailable=10**9)
    clock = iter(range(0, 10**6, 10))
    monkeypatch.setattr(server.time, "monotonic", lambda: next(clock))
    server._resume_itself()
    assert 1 < me.calls <= server.RESUME_TIMEOUT_S / 10 + 2
    assert "could not resume itself" in caplog.text


def test_a_second_resume_joins_the_first():
    started = []

    class Router:
        _resumed = None
        resume = server.RouterActor.resume

        async def _resume(self):
            started.append(1)
            await asyncio.sleep(0)
            return "http://router"

    async def both():
        r = Router()
        return await asyncio.gather(r.resume(), r.resume())

    assert asyncio.run(both()) == ["http://router", "http://router"] and started == [1]
