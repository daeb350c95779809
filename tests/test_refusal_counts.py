"""Refusals counted per plane across an instance's processes (transfer/refusal_counts.py) and
shown by the router's /metrics with its own 401s (router/metrics.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading

from dispatch_fakes import FakeEngine, make, run
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.proto.messages import RefusalCounts
from pdcluster.router.http_app import HttpApp
from pdcluster.router.metrics import RouterMetrics, merge_expositions, refusals_page
from pdcluster.transfer import refusal_counts

CHILD = "from pdcluster.transfer import refusal_counts\nfor _ in range(50): refusal_counts.count('kv_service')"
PARENT = f"""
import os, subprocess, sys
from pdcluster.transfer import refusal_counts
path = refusal_counts.share()
children = [subprocess.Popen([sys.executable, '-c', {CHILD!r}]) for _ in range(3)]
assert all(c.wait() == 0 for c in children)
for _ in range(50): refusal_counts.count('kv_service')
assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == '0o700'
print(refusal_counts.read())
"""


def _count_liveness(n: int) -> None:
    for _ in range(n):
        refusal_counts.count("channel_liveness")


def test_children_count_into_the_file_their_parent_shared_and_the_parent_reads_the_sum():
    # In a process of its own: share() sets that process's environment.
    env = {k: v for k, v in os.environ.items() if k != refusal_counts.ENV}
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(RefusalCounts(kv_service=200))  # 3 children and the parent, none lost


def test_threads_and_a_forked_child_lose_no_count(monkeypatch, tmp_path):
    monkeypatch.setattr(refusal_counts, "_owner", None)
    monkeypatch.setattr(refusal_counts, "_fd", None)
    monkeypatch.delenv(refusal_counts.ENV, raising=False)
    before = refusal_counts.read().channel_liveness  # this process's counts, from the other tests
    refusal_counts.share()
    threads = [threading.Thread(target=_count_liveness, args=(200,)) for _ in range(4)]
    child = multiprocessing.get_context("fork").Process(target=_count_liveness, args=(300,))
    child.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    child.join(30)
    assert child.exitcode == 0
    assert refusal_counts.read().channel_liveness == before + 1100


def test_share_removes_only_its_own_directories_whose_maker_is_gone(monkeypatch, tmp_path):
    """A Ray-killed actor runs no atexit: the next share() on the host removes what it left."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name in (f"pdc-refusals-{gone.pid}-abc", f"pdc-refusals-{os.getpid()}-live", "pdc-refusals-x-y",
                 f"other-{gone.pid}-abc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "counts").write_bytes(b"\0" * 8)
    monkeypatch.setattr(refusal_counts.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(refusal_counts, "_owner", None)
    monkeypatch.setattr(refusal_counts, "_fd", None)
    monkeypatch.delenv(refusal_counts.ENV, raising=False)
    path = refusal_counts.share()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"pdc-refusals-{os.getpid()}-live", "pdc-refusals-x-y", f"other-{gone.pid}-abc",
                           os.path.basename(os.path.dirname(path))])
    assert os.path.basename(os.path.dirname(path)).startswith(f"pdc-refusals-{os.getpid()}-")
    # What else the instance's processes share (tier load times, vLLM's ZMQ sockets) goes there too.
    assert refusal_counts.shared_dir() == os.path.dirname(path)


class RefusingEngine(FakeEngine):
    def __init__(self, counts: RefusalCounts | None):
        super().__init__()
        outer = self

        class _Remote:
            @staticmethod
            def remote():
                async def answer():
                    if outer.counts is None:
                        raise RuntimeError("the actor died")
                    return outer.counts
                return answer()

        self.counts, self.refusals = counts, _Remote()


def series(page: bytes, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(page.decode())
            for s in fam.samples if s.name == name}


def test_metrics_show_each_instances_refusals_per_plane_and_the_routers_401s():
    disp = make([RefusingEngine(RefusalCounts(kv_service=68, channel_liveness=1))],
                [RefusingEngine(RefusalCounts(request_channel=3, kv_events=2)), RefusingEngine(None)])
    counts = run(disp.refusals())
    assert counts == {"prefill-0": RefusalCounts(kv_service=68, channel_liveness=1),
                      "decode-0": RefusalCounts(request_channel=3, kv_events=2)}  # decode-1 did not answer
    app = HttpApp()
    app.require_api_keys(["k"])
    metrics = RouterMetrics(lambda: {}, http_refused=lambda: app.refused)

    async def three_without_a_key():
        sent = []

        async def send(msg):
            sent.append(msg)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        for _ in range(3):
            await app({"type": "http", "method": "GET", "path": "/metrics", "headers": []}, receive, send)
        return [m["status"] for m in sent if m["type"] == "http.response.start"]

    assert asyncio.run(three_without_a_key()) == [401] * 3
    two_routers = merge_expositions([metrics.render(), metrics.render()])  # router.processes: 2
    page = merge_expositions([two_routers, refusals_page(counts)])
    got = series(page, "pdc_refused_total")
    assert got[(("instance", "router"), ("plane", "http"))] == 6  # summed over the routers
    assert got[(("instance", "prefill-0"), ("plane", "kv_service"))] == 68
    assert got[(("instance", "decode-0"), ("plane", "request_channel"))] == 3
    assert got[(("instance", "decode-0"), ("plane", "kv_events"))] == 2
    assert len(got) == 1 + 2 * len(refusal_counts.PLANES)


def test_metrics_show_each_instances_tier_as_it_counts_it():
    from pdcluster.proto.messages import TierCounts
    from pdcluster.router.metrics import tier_counts_page

    page = tier_counts_page({"prefill-0": TierCounts(held_bytes=4096, loaded_blocks=3, loaded_bytes=3072,
                                                     load_seconds=0.25, stored_blocks=5, stored_bytes=5120,
                                                     served_blocks=2)})
    at = (("instance", "prefill-0"), ("tier", "host"))
    assert series(page, "pdc_tier_bytes")[at] == 4096
    assert series(page, "pdc_tier_loaded_bytes_total")[at] == 3072
    assert series(page, "pdc_tier_load_seconds_total")[at] == 0.25
    assert series(page, "pdc_tier_stored_blocks_total")[at] == 5
    assert series(page, "pdc_tier_served_blocks_total")[at] == 2
    assert series(tier_counts_page({}), "pdc_tier_bytes") == {}  # no instance with a tier: no series
