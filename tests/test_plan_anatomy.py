"""Where a planned configuration's time goes and what binds it (cluster/sim/plan_anatomy.py), and
how much more load it takes (cluster/sim/plan_headroom.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.plan import plan
from pdcluster.cluster.sim.plan_anatomy import Anatomy, _binds, _union_ns
from pdcluster.cluster.sim.plan_headroom import headroom, scaled, text
from pdcluster.cluster.sim.plan_types import Slo
from pdcluster.proto.spec import load_spec

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def anat(shares: dict[str, float], p_busy=0.3, d_busy=0.2, refused=0, preemptions=0) -> Anatomy:
    return Anatomy(p_busy, d_busy, p_busy, d_busy, 1.0, shares, refused, preemptions, 0, "")


@pytest.mark.parametrize("a, binds", [
    (anat({"prefill": 0.9}, refused=3), "the router's cap: 3 formal requests refused or failed"),
    (anat({"prefill": 0.9}, preemptions=2), "KV blocks: 2 running requests preempted"),
    (anat({"queue": 0.5, "prefill": 0.45}, p_busy=0.95), "P (busy 95%): P's queue is 50% of TTFT"),
    (anat({"d_wait": 0.4, "prefill": 0.5}), "D (slots 20% held): the wait for D is 40% of TTFT"),
    (anat({"transfer": 0.3, "prefill": 0.5}), "the link: the transfer is 30% of TTFT"),
    (anat({"queue": 0.1, "prefill": 0.85}, p_busy=0.9), "P (busy 90%): at the edge of queueing"),
    (anat({"queue": 0.19, "prefill": 0.8}), "nothing saturates: the prefill itself is 80% of TTFT"),
    (anat({"queue": 0.02, "prefill": 0.95}), "nothing saturates: the prefill itself is 95% of TTFT"),
])
def test_what_binds(a, binds):
    assert _binds(a) == binds


def test_busy_time_is_the_union_of_overlapping_prefills():
    assert _union_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert _union_ns([]) == 0


def test_the_load_scales_by_its_kind():
    rate = BenchConfig(request_rate=6.0, max_concurrency=90)
    assert (scaled(rate, 1.5).request_rate, scaled(rate, 1.5).max_concurrency) == (9.0, 90)
    trace = BenchConfig(trace="t.jsonl", time_scale=1.0)
    assert scaled(trace, 2.0).time_scale == 0.5  # arrivals twice as fast
    closed = BenchConfig(max_concurrency=8)
    assert (scaled(closed, 1.5).max_concurrency, scaled(closed, 1.5).request_rate) == (12, None)


@pytest.fixture(scope="module")
def small_plan():
    cfg = BenchConfig(input_len=32772, shared_prefix_ratio=29 * 1024 / 32772, output_len=32, num_prefixes=6,
                      num_requests=36, max_concurrency=16, request_rate=6.0, progress=False)
    return plan(load_spec(DEPLOY / "p8d8-sim.yaml"), "dsv4-flash-910c", 6, cfg, Slo(1.5, 0.006), "synthetic",
                {"splits": [1, 3]})


def test_a_saturated_p_is_named_and_an_idle_cluster_is_not(small_plan):
    by_split = {o.config.prefill: o.anatomy for o in small_plan.outcomes}
    assert by_split[1].binds.startswith("P (busy") and by_split[1].p_busy > by_split[3].p_busy
    assert by_split[3].binds.startswith("nothing saturates")
    assert abs(sum(by_split[3].ttft_shares.values()) - 1) < 1e-9  # the parts add up to TTFT


def test_the_headroom_is_the_edge_between_a_load_that_holds_and_one_that_does_not(small_plan):
    chosen = small_plan.chosen
    tried: list[tuple[float, bool]] = []
    h = headroom(small_plan, chosen, on_run=lambda m, ok: tried.append((m, ok)))
    held = [m for m, ok in tried if ok]
    missed = [m for m, ok in tried if not ok]
    assert h.factor == max(held) and min(m for m in missed if m > h.factor) <= h.factor * 1.05 + 1e-9
    assert h.factor > 1 and h.runs == len(tried) and h.load == f"{6.0 * h.factor:.2f} req/s"
    assert all(ok for m, ok in tried if m <= h.factor) and not any(ok for m, ok in tried if m > h.factor)
    assert "requests in flight are taken" in h.beyond or "misses the SLO" in h.beyond


def test_a_configuration_that_misses_at_the_plans_load_searches_downwards(small_plan):
    tight = dataclasses.replace(small_plan, slo=Slo(0.5, 0.006))
    p1 = next(o for o in tight.outcomes if o.config.prefill == 1)
    h = headroom(tight, p1)
    assert h.factor is not None and h.factor < 1, h
    assert "it misses the SLO (TTFT p90 " in h.beyond and "> 500.0 ms)" in h.beyond, h.beyond  # which bound


def test_a_configuration_that_never_meets_the_slo_says_so(small_plan):
    never = dataclasses.replace(small_plan, slo=Slo(0.002, 0.0002))  # 2 ms TTFT, 0.2 ms TPOT: no load meets it
    h = headroom(never, never.chosen)
    assert h.factor is None and text(h, never.cfg).startswith(
        "it misses the SLO at every load tried, down to 1/64 of this one; at "), text(h, never.cfg)


def test_conditional_disaggregation_is_swept_and_d_prefills_the_short_remainders(small_plan):
    """Issue 27 item 4: router.local_prefill in the sweep. The load's remainder (3,076 tokens past
    the 29K shared prefix) is under 8,192: once D holds a family, D prefills it itself."""
    from pdcluster.cluster.sim.plan import configure
    from pdcluster.cluster.sim.plan_types import Config

    local = Config(3, 3, 16384, 16, "prefix_aware", None, 8192)
    spec = configure(small_plan.sim_base, local)
    assert (spec.router.local_prefill.policy, spec.router.local_prefill.max_tokens) == ("short_remainder", 8192)
    assert configure(small_plan.sim_base, Config(3, 3, 16384, 16, "prefix_aware", None, 0)
                     ).router.local_prefill.policy == "never"
    p = plan(load_spec(DEPLOY / "p8d8-sim.yaml"), "dsv4-flash-910c", 6, small_plan.cfg, Slo(1.5, 0.006), "synthetic",
             {"splits": [3], "local_prefill": [0, 8192]})
    by = {o.config.local_prefill: o for o in p.outcomes}
    assert by[8192].anatomy.ttft_shares.get("local_prefill", 0) > 0 and "local_prefill" not in by[0].anatomy.ttft_shares
    assert by[8192].config.label.endswith("D prefills <= 8192") and by[0].config.label.endswith("D never prefills")
