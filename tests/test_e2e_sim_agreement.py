"""The virtual clock agrees with the real-time simulated cluster (issue 18 item 2): one P2D2 sim
spec, one short shared-prefix load through the real actors, router and transfer (`pdc bench run`),
then the same load on the virtual clock, figures by cluster/replay/metrics.py from each run's results.

Tolerance: TTFT, TPOT and E2E (mean and p90) within 5%, the measured hit ratio within 0.5 points,
each instance's request count (per role, busiest first) within 2. What the real-time run adds and
the virtual clock does not model (docs/sim.md "Agreement"), measured on this machine while busy:
~4 ms of HTTP and router before P, ~13 ms of real pull after P's last step, ~28 ms for the first
token's way back to the client: ~45 ms of a TTFT. Steps are made long (a prefill step 1 s, a
decode step 100 ms) so that it stays under 5% of a TTFT, as it is at C90's seconds.

Two prefix families on two P: with a third, which P its seed request takes is a tie the real
router breaks by a race (cluster/sim/virtual/agreement.py), and the two runs then queue differently.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from e2e import cluster_spec_for, running_cluster

from pdcluster.cluster.replay.run import BenchConfig, run_bench
from pdcluster.cluster.sim.cost import SimParams
from pdcluster.cluster.sim.virtual.agreement import compare, format_agreement
from pdcluster.cluster.sim.virtual.run import simulate
from pdcluster.proto.spec import SHIPPED_SIM_PARAMS

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray]
TOLERANCE = 0.05
HIT_POINTS = 0.005
COUNT_TOLERANCE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agreement")
    params = SimParams.load(SHIPPED_SIM_PARAMS / "qwen3-0.6b-1dev.yaml").model_dump()
    params["name"] = "qwen3-0.6b-1dev-slow"
    params["overheads"].update(prefill_step_s=1.0, decode_step_s=0.1)
    (tmp / "slow.yaml").write_text(yaml.safe_dump(params))
    spec = cluster_spec_for(
        "e2e-sim-agreement", prefill=2, decode=2,
        engine={"kind": "sim", "max_model_len": 16384, "max_num_batched_tokens": 4096, "max_num_seqs": 8},
        sim={"params": str(tmp / "slow.yaml"), "kv_blocks": 1024}, router={"policy": "prefix_aware"})
    cfg = BenchConfig(input_len=6000, shared_prefix_ratio=0.5, output_len=8, num_prefixes=2, num_requests=14,
                      max_concurrency=4, request_rate=1.5, progress=False, out=str(tmp / "real"))
    with running_cluster(spec) as cluster:
        real = run_bench(dataclasses.replace(cfg, base_url=cluster.url), log=lambda m: None)
    virtual = simulate(spec, cfg, real.requests)
    return real, virtual


def test_the_virtual_clock_agrees_with_the_real_time_sim(runs):
    real, virtual = runs
    assert all(r.ok for r in real.results) and all(r.ok for r in virtual.results)
    agreement = compare(real.summaries["formal"], virtual.summaries["formal"], list(real.timelines.values()),
                        virtual.records)
    print(format_agreement(agreement))
    assert agreement.outside(TOLERANCE, COUNT_TOLERANCE) == [], format_agreement(agreement)
    hit = agreement.figure("hit ratio")
    assert abs(hit.other - hit.reference) <= HIT_POINTS


def test_both_served_every_request_with_the_hits_the_workload_expects(runs):
    real, virtual = runs
    assert real.hit_mismatches == [] and virtual.hit_mismatches == []
    assert len(virtual.results) == len(real.results) == 2 + 2 + 14
