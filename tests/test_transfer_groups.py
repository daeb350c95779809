"""KV-cache groups -> transfer kinds (transfer/groups.py) and their block plans (transfer/plan.py),
on the groups vLLM 0.32 gives DeepSeek-V4 (the tiny model: layers with compress ratio 4, 128, 0).

vLLM's groups for it, as the probes dumped them (../shared/probes/README.md), each a
UniformTypeKVCacheSpecs wrapper around per-layer specs:
  G0  block 256  MLAAttentionSpec        C4 KV, C128 KV, C4 indexer keys (one entry per 4 / 128 tokens)
  G1  block 4    SlidingWindowMLASpec    C4 compressor states (main and indexer), window 8
  G2-4 block 64  SlidingWindowMLASpec    per-layer sliding-window KV, window 128
  G5  block 8    SlidingWindowMLASpec    C128 compressor state, window 128
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from pdcluster.transfer.groups import GroupInfo, describe_groups
from pdcluster.transfer.plan import PlanError, plan_transfer


def mla(tokens_per_state: int, head_size: int = 512, **kw) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=head_size, dtype=torch.uint8,
                            tokens_per_state=tokens_per_state, **kw)


def window(block_size: int, sliding_window: int, head_size: int = 512, dtype=torch.float32, **kw):
    return SlidingWindowMLASpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype,
                                sliding_window=sliding_window, **kw)


def uniform(**specs) -> UniformTypeKVCacheSpecs:
    wrapped = UniformTypeKVCacheSpecs.from_specs(specs)
    assert wrapped is not None, specs
    return wrapped


def dsv4_config() -> KVCacheConfig:
    fp8_window = dict(dtype=torch.uint8, cache_dtype_str="fp8_ds_mla", model_version="deepseek_v4")
    groups = {
        "G0": uniform(**{"layers.0.attn.indexer.k_cache": mla(4, head_size=132),
                         "layers.0.attn": mla(4, model_version="deepseek_v4", cache_dtype_str="fp8_ds_mla"),
                         "layers.1.attn": mla(128, model_version="deepseek_v4", cache_dtype_str="fp8_ds_mla")}),
        "G1": uniform(**{"layers.0.attn.indexer.compressor.state_cache": window(4, 8),
                         "layers.0.attn.compressor.state_cache": window(4, 8, head_size=2048)}),
        "G2": uniform(**{"layers.0.attn.swa_cache": window(64, 128, **fp8_window)}),
        "G3": uniform(**{"layers.1.attn.swa_cache": window(64, 128, **fp8_window)}),
        "G4": uniform(**{"layers.2.attn.swa_cache": window(64, 128, **fp8_window)}),
        "G5": uniform(**{"layers.1.attn.compressor.state_cache": window(8, 128, head_size=1024)}),
    }
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(s.kv_cache_specs), s) for s in groups.values()])


DSV4 = describe_groups(dsv4_config())


def test_dsv4_groups_get_their_kinds_block_sizes_and_windows():
    assert [(g.kind, g.spec_name, g.block_size, g.window_blocks) for g in DSV4] == [
        ("compressed", "MLAAttentionSpec", 256, 0),
        ("sliding_window", "SlidingWindowMLASpec", 4, 3),  # window 8 in 4-token blocks: 2 (+1, unaligned)
        ("sliding_window", "SlidingWindowMLASpec", 64, 3),
        ("sliding_window", "SlidingWindowMLASpec", 64, 3),
        ("sliding_window", "SlidingWindowMLASpec", 64, 3),
        ("sliding_window", "SlidingWindowMLASpec", 8, 17),  # window 128 in 8-token blocks
    ]
    # A wrapper's page already sums its layers; it is not multiplied again.
    config = dsv4_config()
    assert [g.page_bytes for g in DSV4] == [g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups]
    assert DSV4[0].page_bytes == sum(s.page_size_bytes for s in config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs
                                     .values())


def d_allocation(n: int, hit: int, g: GroupInfo) -> tuple[int, ...]:
    """The blocks D allocates past its hit for a prompt of n tokens, as vLLM does: every block
    (full, compressed), or only those from the one holding token n - window on (window: the
    window of token n-1, which D recomputes; cluster/vllm_patches.py makes vLLM keep it).
    Fake ids: 1000 * group + block index."""
    first = hit // g.block_size
    if g.window_blocks:
        window = {4: 8, 64: 128, 8: 128}[g.block_size]
        first = max(first, max(0, n - window) // g.block_size)
    return tuple(1000 * g.index + i for i in range(first, -(-n // g.block_size)))


def plan(n: int, hit: int):
    local = tuple(d_allocation(n, hit, g) for g in DSV4)
    hits = tuple(hit // g.block_size for g in DSV4)
    return plan_transfer(DSV4, local, hits, d_cached_tokens=hit, num_tokens=n)


@pytest.mark.parametrize("n, hit, blocks", [
    # prompt tokens, D's prefix hit (a multiple of 256): blocks per group G0..G5
    (100, 0, (1, 2, 2, 2, 2, 13)),  # 4-token group: only the blocks of the last 8 tokens
    (128, 0, (1, 2, 2, 2, 2, 16)),
    (129, 0, (1, 3, 3, 3, 3, 17)),  # 129 - 128 + 1: the windows start one token into a block
    (191, 0, (1, 3, 3, 3, 3, 17)),  # token 190's window starts at 63, the last token of block 0
    (255, 0, (1, 3, 3, 3, 3, 17)),
    (256, 0, (1, 2, 2, 2, 2, 16)),
    (257, 0, (2, 3, 3, 3, 3, 17)),  # one token into the second 256-token block
    (300, 0, (2, 2, 3, 3, 3, 17)),
    (600, 256, (2, 2, 3, 3, 3, 16)),  # D holds the first 256: compressed moves the rest only
    (1000, 512, (2, 2, 3, 3, 3, 16)),
    (520, 512, (1, 2, 1, 1, 1, 1)),  # the windows reach below D's hit: D's own blocks serve them
])
def test_dsv4_plan_moves_exact_blocks_per_group(n, hit, blocks):
    p = plan(n, hit)
    assert tuple(g.num_blocks for g in p.groups) == blocks
    assert [g.kind for g in p.groups] == ["compressed"] + ["sliding_window"] * 5
    assert (p.d_cached_tokens, p.transferred_tokens) == (hit, n - hit)
    for g, info in zip(p.groups, DSV4):
        num_remote = -(-n // info.block_size)
        # P's blocks by index in its block table: the compressed group from D's hit on,
        # a window group its tail, never more than the window holds.
        first = num_remote - g.num_blocks
        assert g.remote_indices == tuple(range(first, num_remote))
        assert g.local_block_ids == tuple(1000 * info.index + i for i in range(first, num_remote))
        if info.window_blocks:
            assert g.num_blocks <= info.window_blocks
        else:
            assert first == hit // info.block_size


def test_dsv4_window_group_wanting_more_than_the_window_is_an_error():
    local = list(d_allocation(600, 0, g) for g in DSV4)
    local[5] = tuple(range(18))  # 18 blocks of 8 tokens: more than a 128-token window can touch
    with pytest.raises(PlanError, match="group 5: D wants 18 window blocks, P holds only 17"):
        plan_transfer(DSV4, tuple(local), (0,) * 6, d_cached_tokens=0, num_tokens=600)


def group_of(spec, layers: int = 1) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(layers)], spec)])


def test_plain_specs_keep_their_kinds():
    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    (g,) = describe_groups(group_of(full, layers=3))
    assert (g.kind, g.spec_name, g.window_blocks, g.page_bytes) == ("full_attention", "FullAttentionSpec", 0,
                                                                    3 * full.page_size_bytes)
    swa = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=256)
    (g,) = describe_groups(group_of(swa))
    assert (g.kind, g.spec_name, g.block_size, g.window_blocks) == ("sliding_window", "SlidingWindowSpec", 128, 3)
    # MLA latent KV (one entry per token, DeepSeek-V2/V3): full attention's rule and name.
    assert describe_groups(group_of(mla(1)))[0].kind == "full_attention"
    # Hybrid manager off: vLLM allocates a window layer as full attention; it moves as one.
    promoted = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                 sliding_window=256)
    assert describe_groups(group_of(promoted))[0].kind == "full_attention"


def test_recurrent_state_is_not_transferred_and_says_why():
    mamba = MambaSpec(block_size=4096, shapes=((4, 16), (8, 8)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(NotImplementedError, match=r"KV-cache group 0: MambaSpec \(recurrent state, "
                                                  r"mamba_cache_mode='none'\).*last token .* twice"):
        describe_groups(group_of(mamba))


def test_unsupported_groups_are_named():
    with pytest.raises(NotImplementedError, match="KV-cache group 0: .*bounded_replay"):
        describe_groups(group_of(window(64, 128, bounded_replay=True)))
    mixed = UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs={"a": mla(4), "b": mla(1)})
    with pytest.raises(NotImplementedError, match=r"group 0 mixes layers that move differently"):
        describe_groups(group_of(mixed))
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    chunked = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                        attention_chunk_size=512)
    with pytest.raises(NotImplementedError, match="group 0: ChunkedLocalAttentionSpec: pdcluster has no transfer rule"):
        describe_groups(group_of(chunked))
