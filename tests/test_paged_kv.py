"""PagedKv: one engine's paged KV cache addressed by (layer, block ids), in vLLM's CPU and
flash-attn layouts; the bytes P frames straight from its cache and D writes run by run."""

from __future__ import annotations

import pytest
import torch
from transfer_fakes import (
    GROUPS,
    LAYERS,
    P_BLOCKS,
    assert_zero_except,
    cpu_shape,
    flash_shape,
    source_caches,
    zero_caches,
)

from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.paged_kv import PagedKv, block_runs


def test_paged_kv_cpu_layout_block_dim_first():
    caches = source_caches(cpu_shape(P_BLOCKS))
    kv = PagedKv(caches, GROUPS, P_BLOCKS)
    info = kv.layers[LAYERS[1]]
    assert (info.name, info.group, info.block_shape, info.dtype) == (LAYERS[1], 0, (2, 16, 32), torch.float32)
    assert info.block_bytes == 2 * 16 * 32 * 4
    data = kv.read(LAYERS[1], [7, 2])
    assert data == torch.stack([caches[LAYERS[1]][7], caches[LAYERS[1]][2]]).numpy().tobytes()


def test_paged_kv_flash_layout_finds_block_dim_1():
    caches = source_caches(flash_shape(P_BLOCKS))
    kv = PagedKv(caches, GROUPS, P_BLOCKS)
    assert kv.layers[LAYERS[0]].block_shape == (2, 8, 4)
    assert kv.layers[LAYERS[0]].block_bytes == 2 * 8 * 4 * 4
    t = caches[LAYERS[0]]
    assert kv.read(LAYERS[0], [3]) == t[:, 3].contiguous().numpy().tobytes()

    # Writes land in the caller's tensor (the view shares its storage).
    dst = zero_caches(flash_shape(P_BLOCKS))
    PagedKv(dst, GROUPS, P_BLOCKS).write(LAYERS[0], [10, 4], kv.read(LAYERS[0], [3, 5]))
    assert torch.equal(dst[LAYERS[0]][:, 10], t[:, 3])
    assert torch.equal(dst[LAYERS[0]][:, 4], t[:, 5])
    assert_zero_except({LAYERS[0]: dst[LAYERS[0]]}, 1, P_BLOCKS, written=(10, 4))
    assert not dst[LAYERS[1]].any()


def test_paged_kv_no_block_dim_raises():
    caches = {LAYERS[0]: torch.zeros(2, 3, 8, 4)}
    with pytest.raises(ValueError, match=r"no dimension of size num_blocks=12 in KV tensor of shape \(2, 3, 8, 4\)"):
        PagedKv(caches, GROUPS, P_BLOCKS)


def test_paged_kv_write_wrong_size_raises():
    kv = PagedKv(zero_caches(cpu_shape(P_BLOCKS)), GROUPS, P_BLOCKS)
    with pytest.raises(ValueError, match="expected 8192"):
        kv.write(LAYERS[0], [1, 2], b"\0" * 4096)


def test_paged_kv_layer_without_group_asserts():
    with pytest.raises(AssertionError, match="in no KV-cache group"):
        PagedKv(zero_caches(cpu_shape(P_BLOCKS)), {LAYERS[0]: 0}, P_BLOCKS)



@pytest.mark.parametrize("ids, runs", [
    ([], []),
    ([5], [(5, 1)]),
    ([3, 4, 5, 9], [(3, 3), (9, 1)]),
    ([9, 3, 4], [(9, 1), (3, 2)]),  # order kept: a run only continues upwards
    ([2, 1], [(2, 1), (1, 1)]),
])
def test_block_runs(ids, runs):
    assert block_runs(ids) == runs


@pytest.mark.parametrize("ids", [[1, 2, 3, 4], [7, 2, 3, 10, 11, 5], [11, 10, 9]])
def test_byte_runs_are_the_gathered_bytes_in_place(ids):
    caches = source_caches(cpu_shape(P_BLOCKS))
    kv = PagedKv(caches, GROUPS, P_BLOCKS)
    runs = kv.byte_runs(LAYERS[0], ids)
    assert len(runs) == len(block_runs(ids))
    assert b"".join(runs) == kv.read(LAYERS[0], ids)
    caches[LAYERS[0]][ids[0]].fill_(-1.0)  # views, not copies: they see the cache change
    assert bytes(runs[0][:4]) == torch.tensor([-1.0]).numpy().tobytes()


def test_byte_runs_none_where_a_block_is_not_one_span():
    kv = PagedKv(source_caches(flash_shape(P_BLOCKS)), GROUPS, P_BLOCKS)  # [2, num_blocks, ...]: K and V apart
    assert kv.byte_runs(LAYERS[0], [3, 4]) is None


@pytest.mark.parametrize("shape", [cpu_shape, flash_shape])
@pytest.mark.parametrize("dst_ids", [[1, 2, 3, 4, 5], [9, 2, 3, 11, 6], [5, 4, 3, 2, 1]])
def test_write_puts_each_block_in_place_whatever_the_runs(shape, dst_ids):
    src = source_caches(shape(P_BLOCKS))
    src_ids = [2, 3, 7, 8, 9]
    data = PagedKv(src, GROUPS, P_BLOCKS).read(LAYERS[1], src_ids)
    dst = zero_caches(shape(P_BLOCKS))
    kv = PagedKv(dst, GROUPS, P_BLOCKS)
    kv.write(LAYERS[1], dst_ids, data)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kv.view(LAYERS[1])[d], PagedKv(src, GROUPS, P_BLOCKS).view(LAYERS[1])[s])
    assert_zero_except({LAYERS[1]: dst[LAYERS[1]]}, 1 if shape is flash_shape else 0, P_BLOCKS, written=tuple(dst_ids))
    assert not dst[LAYERS[0]].any()


def test_a_frame_of_byte_runs_equals_a_frame_of_the_gathered_blocks():
    kv = PagedKv(source_caches(cpu_shape(P_BLOCKS)), GROUPS, P_BLOCKS)
    chunk = pb.KvChunk(layer=LAYERS[0], group=0, first=0, count=4)
    ids = [4, 5, 1, 2]
    assert frames.encode(chunk, kv.byte_runs(LAYERS[0], ids)) == frames.encode(chunk, kv.gather(LAYERS[0], ids))
