"""vLLM-Ascend's KV layout: NPUModelRunner registers a tuple of tensors per layer
((k_cache, v_cache), or with DeepSeek's sparse attention also indexer keys and scales, each
its own shape and dtype). PagedKv moves each part as a layer of its own; here a real gRPC
pull between a P and a D holding that layout (CPU tensors: no NPU on this machine)."""

from __future__ import annotations

import pytest
import torch
from transfer_fakes import BLOCK_SIZE, SECRET, make_job, offer, wait_results

from pdcluster.transfer.grpc_client import KvFetcher
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.sources import SourceTable

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
GROUPS = dict.fromkeys(LAYERS, 0)


def npu_caches(num_blocks: int, seed: int | None) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each layer as (k, v, dsa_k, dsa_k_scale): [num_blocks, block_size, ...] each (zeros: seed None)."""
    g = torch.Generator().manual_seed(seed or 0)

    def t(*shape, dtype=torch.float16):
        return torch.zeros(shape, dtype=dtype) if seed is None else torch.rand(shape, generator=g).to(dtype)

    return {name: (t(num_blocks, BLOCK_SIZE, 2, 8), t(num_blocks, BLOCK_SIZE, 2, 8),
                   t(num_blocks, BLOCK_SIZE, 1, 16, dtype=torch.bfloat16),
                   t(num_blocks, BLOCK_SIZE, 1, dtype=torch.float32)) for name in LAYERS}


def test_each_part_of_a_tuple_layer_is_a_layer_of_its_own():
    kv = PagedKv(npu_caches(6, seed=1), GROUPS, 6)
    assert list(kv.layers) == [f"{name}[{i}]" for name in LAYERS for i in range(4)]
    info = kv.layers[f"{LAYERS[1]}[2]"]
    assert (info.group, info.block_shape, info.dtype, info.vllm_layer) == (0, (BLOCK_SIZE, 1, 16), torch.bfloat16,
                                                                          LAYERS[1])
    assert kv.layers[f"{LAYERS[0]}[3]"].block_bytes == BLOCK_SIZE * 4


@pytest.fixture
def p_and_d():
    p_caches, d_caches = npu_caches(12, seed=3), npu_caches(16, seed=None)
    p_kv = PagedKv(p_caches, GROUPS, 12)
    sources = SourceTable(GROUPS, (BLOCK_SIZE,))  # P's forward pass marks vLLM's layers, not the parts
    server = KvServer("p0", p_kv, sources, "127.0.0.1", 0, 1 << 20, secret=SECRET, wait_s=0.3)
    fetcher = KvFetcher("d0", PagedKv(d_caches, GROUPS, 16), 2.0, secret=SECRET)
    yield p_caches, d_caches, sources, server, fetcher
    fetcher.stop()
    server.stop()


def test_a_pull_copies_every_part_of_every_planned_block(p_and_d):
    p_caches, d_caches, sources, server, fetcher = p_and_d
    p = type("P", (), {"sources": sources})()
    offer(p, "r1", (2, 5, 7, 9))
    fetcher.submit(make_job(server.address, (0, 1, 3), (0, 15, 4)))  # P blocks 2, 5, 9
    assert wait_results(fetcher, {"d-r1"}).failed == set()
    for name in LAYERS:
        for part, (src, dst) in enumerate(zip(p_caches[name], d_caches[name])):
            for pb_id, lb in zip((2, 5, 9), (0, 15, 4)):
                assert torch.equal(dst[lb], src[pb_id]), f"{name}[{part}]: D block {lb} != P block {pb_id}"
            untouched = [b for b in range(16) if b not in (0, 15, 4)]
            assert not dst[untouched].any(), f"{name}[{part}]: blocks outside the plan were written"
