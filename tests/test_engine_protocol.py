"""The engine contract (proto/engine.py): the vLLM, simulated and instant engine bodies each declare
it and define every one of its methods themselves, with its parameters and its kind."""

from __future__ import annotations

import inspect

import pytest

from pdcluster.bench.instant_engine import InstantEngine
from pdcluster.cluster.engine_actor import EngineActor
from pdcluster.cluster.sim.engine import SimEngineActor
from pdcluster.proto.engine import Engine

BODIES = (EngineActor, SimEngineActor, InstantEngine)
METHODS = ("info", "clock", "load", "health", "refusals", "prefill", "decode", "open_pool", "tier_counts",
           "reset_prefix_cache", "shutdown")
# decode streams: an async generator in every body, though the protocol can only say it returns one.
STREAMS = {"decode"}


def kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "plain"


def mismatches(body: type) -> list[str]:
    out = []
    if Engine not in body.__mro__:
        out.append(f"{body.__name__} does not declare Engine")
    for name in METHODS:
        mine = body.__dict__.get(name) or next((k.__dict__[name] for k in body.__mro__
                                                if name in k.__dict__ and k is not Engine), None)
        if mine is None:
            out.append(f"{body.__name__}.{name} is missing (only the protocol's stub)")
            continue
        want = "async generator" if name in STREAMS else kind(getattr(Engine, name))
        if kind(mine) != want:
            out.append(f"{body.__name__}.{name} is a {kind(mine)}, not {want}")
        theirs, ours = inspect.signature(getattr(Engine, name)), inspect.signature(mine)
        if list(theirs.parameters) != list(ours.parameters):
            out.append(f"{body.__name__}.{name}{ours} does not take {theirs}")
    return out


def test_the_protocol_is_the_nine_methods():
    assert sorted(n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")) == sorted(METHODS)


@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.__name__)
def test_each_engine_body_implements_the_protocol(body):
    assert mismatches(body) == []


def test_a_body_missing_a_method_or_with_another_signature_is_named():
    class Partial(Engine):
        async def info(self):
            pass

        def clock(self, extra):
            return 0

        async def decode(self, req):  # a coroutine, not a stream
            return None

    found = mismatches(Partial)
    assert "Partial.clock(self, extra) does not take (self) -> 'int'" in found
    assert "Partial.decode is a coroutine, not async generator" in found
    assert "Partial.prefill is missing (only the protocol's stub)" in found
    assert len(found) == 10  # clock's signature, decode's kind, eight missing
