"""The chaos soak, short (bench/chaos.py), across hosts: c90-tiny through a simulated P2D2 in a
4-host lab (P on host1/host2, D on host3/host4, the router on the head) while a random P or D is
killed every few seconds (Ray restarts it) and the path between a random P's host and D's host is
cut for a few seconds at a time (dropped on the bridge, then healed). Nothing may be lost: every
request is answered, every stream is exactly the undisturbed output, every KV block is free once
idle, and every answered request has its record. The full C90 run's figures are in bench/README.md."""

from __future__ import annotations

import dataclasses

import pytest
from e2e import cluster_spec_for, running_cluster, shared_lab

from pdcluster.bench.chaos import ChaosPlan, format_report, in_lab, soak
from pdcluster.cluster.replay.run import BenchConfig

# The 4-host lab of test_e2e_multihost_faults (tests/e2e.py shared_lab), not bench/chaos.py's own.
pytestmark = [pytest.mark.e2e, pytest.mark.shared_lab("lab4")]


@pytest.fixture(scope="module")
def lab():
    return shared_lab("lab4")


@pytest.fixture(scope="module")
def cluster(lab):
    spec = cluster_spec_for(
        "e2e-chaos", prefill=2, decode=2,
        engine={"kind": "sim", "max_model_len": 8192, "max_num_batched_tokens": 2048, "max_num_seqs": 16},
        sim={"params": "qwen3-0.6b-1dev", "payload_scale": 1024, "kv_blocks": 512},
        # A cut lasts longer than a transfer may wait: the requests it catches fail (502) or go on.
        transfer={"lease_s": 10, "timeout_s": 4},  # a dead D's leases on P end soon: the idle check is quick
        # round_robin: every (P, D) pair carries requests, so each cut has transfers to catch
        # (prefix_aware keeps a family on one P; a cut between two quiet hosts caught none).
        router={"policy": "round_robin", "request_timeout_s": 60})
    with running_cluster(in_lab(spec, lab)) as c:
        yield c


def test_a_soak_with_instances_killed_and_links_cut_loses_nothing(cluster, lab):
    cfg = dataclasses.replace(BenchConfig.from_preset("c90-tiny", num_requests=48), base_url=cluster.url,
                              engine_block_size=128, progress=False, out=None)
    plan = ChaosPlan(kill_every_s=3.0, cut_every_s=2.0, cut_for_s=5.0, seed=1)
    report = soak(cluster, cfg, plan, lab, log=lambda *_: None)
    print(format_report(report))
    assert len(report.kills) >= 4 and len(report.cuts) >= 2, "the soak ended before the chaos did much"
    assert report.lost == 0, report.errors
    assert report.wrong_streams == 0, report.errors
    assert not any(report.blocks_in_use.values()), report.blocks_in_use
    assert report.records == report.answered
    assert report.succeeded + report.failed + report.rejected == report.sent
    assert report.migrated + report.retried > 0, "no request was on a killed instance"
    assert report.cut_transfers > 0, "no transfer was under a cut"
    assert not lab.partitions, "a cut was left in place"
