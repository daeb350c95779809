"""The chaos soak, short (bench/chaos.py): c90-tiny through a simulated P2D2 while a random P or
D is killed every few seconds (Ray restarts it). Nothing may be lost: every request is answered,
every stream is exactly the undisturbed output, every KV block is free once idle, and every
answered request has its record. The full C90 run's figures are in bench/README.md."""

from __future__ import annotations

import dataclasses

import pytest
from e2e import cluster_spec_for, running_cluster

from pdcluster.bench.chaos import format_report, soak
from pdcluster.bench.run import BenchConfig

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    spec = cluster_spec_for(
        "e2e-chaos", prefill=2, decode=2,
        engine={"kind": "sim", "max_model_len": 8192, "max_num_batched_tokens": 2048, "max_num_seqs": 16},
        sim={"params": "qwen3-0.6b-1dev", "payload_scale": 1024, "kv_blocks": 512},
        transfer={"lease_s": 10, "timeout_s": 10},  # a dead D's leases on P end soon: the idle check is quick
        router={"policy": "prefix_aware", "request_timeout_s": 60})
    with running_cluster(spec) as c:
        yield c


def test_a_soak_with_instances_killed_loses_nothing(cluster):
    cfg = dataclasses.replace(BenchConfig.from_preset("c90-tiny", num_requests=48), base_url=cluster.url,
                              engine_block_size=128, progress=False, out=None)
    report = soak(cluster, cfg, every_s=3.0, seed=1, log=lambda *_: None)
    print(format_report(report))
    assert len(report.kills) >= 4, "the soak ended before the chaos did much"
    assert report.lost == 0, report.errors
    assert report.wrong_streams == 0, report.errors
    assert not any(report.blocks_in_use.values()), report.blocks_in_use
    assert report.records == report.answered
    assert report.succeeded + report.failed + report.rejected == report.sent
    assert report.migrated + report.retried > 0, "no request was on a killed instance"
