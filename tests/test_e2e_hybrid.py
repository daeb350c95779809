"""End to end on hybrid models, one P1D1 cluster per model:

- tiny Gemma3: 5 sliding-window layers (window 256) + 1 full layer: 6 KV-cache groups;
- tiny gpt-oss: layers alternating window 128 / full, attention sinks, MoE: 2 groups.

The connector supports vLLM's hybrid KV cache manager (SupportsHMA), so each
layer kind keeps its own KV-cache group, and a window group moves only the
blocks its window covers. Tokens must equal a single engine's (the probes saw
vLLM's ExampleConnector give unstable tokens on gpt-oss).

P has a host KV tier, a max_model_len of 3,072 tokens and a device pool just over what vLLM asks
for one such prompt (a prefill allocates every group, windows included, a block per block of the
prompt before vLLM frees those the window left): a prompt P evicted comes back from its tier, full
groups whole and each window group's window (transfer/tier_scheduler.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import ray
from e2e import (
    MODEL_CACHE,
    assert_no_kv_in_use,
    cluster_spec_for,
    complete,
    local_ray,
    running_cluster,
    serve_over_each_transport,
)

from pdcluster.cluster.reference_engine import GreedyReference
from pdcluster.cluster.tiny_model import GEMMA3_WINDOW, GPTOSS_WINDOW, cached_tiny_model
from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeRequest, PoolRequest, SamplingSpec
from pdcluster.router.run_store import load_run

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray]
BLOCK = 128


@dataclass(frozen=True)
class Hybrid:
    arch: str
    window: int
    window_groups: int
    full_groups: int

    @property
    def p_blocks(self) -> int:
        """P's device pool: its max_model_len's 24 blocks in every group, and 6 more."""
        return 24 * (self.window_groups + self.full_groups) + 6


HYBRIDS = [Hybrid("gemma3", GEMMA3_WINDOW, 5, 1), Hybrid("gptoss", GPTOSS_WINDOW, 1, 1)]
FULL = (3000 - 1) // BLOCK * BLOCK  # of a 3,000-token prompt, what can hit


@pytest.fixture(scope="module", params=HYBRIDS, ids=lambda h: h.arch)
def hybrid(request) -> Hybrid:
    return request.param


@pytest.fixture(scope="module")
def model_dir(hybrid):
    return str(cached_tiny_model(MODEL_CACHE / f"tiny-{hybrid.arch}", arch=hybrid.arch))


@pytest.fixture(scope="module")
def reference(model_dir):
    """The single engine to compare with, made before the cluster: its start runs beside the
    cluster's engines'."""
    local_ray()
    engine = ray.remote(num_cpus=0)(GreedyReference).remote(model_dir, "0")
    yield engine
    ray.kill(engine)


@pytest.fixture(scope="module")
def cluster(model_dir, hybrid, reference):
    # P's tier keeps every window block of each prompt (each block boundary's window, as vLLM's own
    # cache does): room for all five 3,000-token prompts below.
    spec = cluster_spec_for(f"e2e-{hybrid.arch}", model={"path": model_dir, "name": "tiny-qwen3"},
                            prefill_engine={"host_tier_gib": 0.25, "max_model_len": 3072, "max_num_batched_tokens": 3072,
                                            "extra": {"num_gpu_blocks_override": hybrid.p_blocks}})
    with running_cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def served(cluster, reference):
    """Prompts around the window and block boundaries, some extending earlier ones (D holds a prefix)."""
    rng = random.Random(11)
    base = [rng.randrange(3, 1000) for _ in range(3000)]
    prompts = [base[:n] for n in (100, 255, 256, 257, 300, 600, 1000, 1000, 1500, 3000)]
    prompts.append([rng.randrange(3, 1000) for _ in range(700)])
    wants = [ray.get(reference.greedy.remote(p, 8)) for p in prompts]
    return serve_over_each_transport(cluster, prompts, wants)


def test_tokens_equal_a_single_engine(served):
    """Over gRPC and over torch.distributed (gloo)."""
    mismatches = [(len(p), body["choices"][0]["token_ids"], want) for p, body, want in served
                  if body["choices"][0]["token_ids"] != want]
    assert not mismatches, mismatches


def test_window_groups_move_only_the_window(cluster, served, hybrid):
    records = {r.request_id: r for r in load_run(cluster.run_dir).records}
    for prompt, body, _ in served:
        rec = records[body["id"]]
        n, hit = len(prompt), rec.d_cached_tokens
        n_blocks, hit_blocks = -(-n // BLOCK), hit // BLOCK
        # vLLM keeps a window layer's blocks from the one holding token n - window on.
        first_window_block = max(0, n - hybrid.window + 1) // BLOCK
        expected_window = n_blocks - max(hit_blocks, first_window_block)
        blocks = sorted(g.blocks for g in rec.transfer_groups)
        # One group per layer kind (HMA on); a window group never moves more than the full one.
        assert len(blocks) == hybrid.window_groups + hybrid.full_groups, blocks
        assert blocks == [expected_window] * hybrid.window_groups + [n_blocks - hit_blocks] * hybrid.full_groups, (
            n, hit, blocks)
        assert expected_window <= -(-hybrid.window // BLOCK) + 1  # bounded by the window, not the prompt
        # Each group named by its kind and vLLM's spec, for the reports.
        kinds = sorted(g.name.split(" ")[0] for g in rec.transfer_groups)
        assert kinds == ["full_attention"] * hybrid.full_groups + ["sliding_window"] * hybrid.window_groups, kinds


def test_a_prompt_p_evicted_comes_back_from_its_host_tier_window_groups_included(cluster, served, reference):
    prompt, _, want = next((p, b, w) for p, b, w in served if len(p) == 3000)
    rng = random.Random(12)
    for _ in range(4):  # other 3,000-token prompts: P's device pool lets go of the first's blocks
        r = complete(cluster.url, [rng.randrange(3, 1000) for _ in range(3000)], 1)
        assert r.status_code == 200, r.text
    # A prompt sharing only its first 2,000 tokens: the tier's hit ends at the last block boundary
    # they share, whose window blocks the tier kept as P's prefill passed it (by the prompt's end
    # vLLM had freed them).
    shared = prompt[:2000] + [rng.randrange(3, 1000) for _ in range(500)]
    assert ray.get(cluster.decode[0].actor.reset_prefix_cache.remote())  # D holds nothing: P prefills it all
    cluster.each_router("catch_up_kv_events")
    r = complete(cluster.url, shared, 8)
    assert r.status_code == 200, r.text
    rec = load_run(cluster.run_dir).record(r.json()["id"])
    assert (rec.p_cached_tokens, rec.predicted_p_hit_tokens) == (1920, 1920) and rec.p_tier_tokens > 0, (
        rec.p_cached_tokens, rec.predicted_p_hit_tokens, rec.p_tier_tokens)
    assert r.json()["choices"][0]["token_ids"] == ray.get(reference.greedy.remote(shared, 8))
    assert ray.get(cluster.decode[0].actor.reset_prefix_cache.remote())
    cluster.each_router("catch_up_kv_events")
    r = complete(cluster.url, prompt, 8)
    assert r.status_code == 200, r.text
    rec = load_run(cluster.run_dir).record(r.json()["id"])
    # What P's device cache still held, and the rest from its tier: every block that can hit.
    assert (rec.p_cached_tokens, rec.d_cached_tokens) == (FULL, 0) and rec.p_tier_tokens > 0, (
        rec.p_cached_tokens, rec.p_tier_tokens, rec.d_cached_tokens)
    assert r.json()["choices"][0]["token_ids"] == want
    # The router's index counts the hit as vLLM does, window groups and tier included (InstanceInfo.kv_groups).
    assert (rec.predicted_p_hit_tokens, rec.predicted_p_tier_tokens) == (FULL, rec.p_tier_tokens), (
        rec.predicted_p_hit_tokens, rec.predicted_p_tier_tokens, rec.p_tier_tokens)


def test_d_reads_a_prefix_from_ps_tier_window_groups_included(cluster, served):
    """The pool on a hybrid model: P offers the full groups' run and each window group's window
    before its end (HostTier.read_run); D pulls them and computes the rest; P runs no step."""
    prompt, _, want = next((p, b, w) for p, b, w in served if len(p) == 3000)  # in P's tier since served
    p, d = cluster.prefill[0], cluster.decode[0]
    assert ray.get(d.actor.reset_prefix_cache.remote())
    steps = ray.get(p.actor.load.remote()).steps
    assert ray.get(p.actor.open_pool.remote(PoolRequest("hybrid-pool", prompt))).num_tokens == FULL
    handle = TransferHandle(p.engine_id, p.kv_address, "hybrid-pool", FULL)
    deltas = [ray.get(ref) for ref in d.actor.decode.options(num_returns="streaming").remote(
        DecodeRequest("hybrid-pool-d", prompt, SamplingSpec(max_tokens=8, temperature=0, ignore_eos=True), handle))]
    last = deltas[-1].transfer
    assert last.error is None and (last.d_cached_tokens, last.transferred_tokens) == (0, FULL), last
    assert [t for delta in deltas for t in delta.new_token_ids] == want
    assert ray.get(p.actor.load.remote()).steps == steps  # P computed nothing


def test_no_blocks_leak(cluster, served):
    assert_no_kv_in_use(cluster, 10)
