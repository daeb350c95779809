"""vLLM 0.23's KV events are tagged arrays ([tag, field, ...]), 0.26 and later tagged maps: the
router's decoder reads both. The 0.23 encoder here is vLLM 0.23's event classes as declared in
its source (their field order checked against it when that source is fetched)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from vllm_source_ast import Source, fetched

from pdcluster.proto.kv_event_wire import BlockRemoved, BlockStored, decode_batch


class Event023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored023(Event023, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved023(Event023, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared023(Event023, tag="AllBlocksCleared"):
    pass


class Batch023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def test_vllm_023s_array_events_decode_as_the_newer_maps_do():
    stored = BlockStored023([b"\x01" * 32, 7], None, list(range(32)), 16, None, "GPU", None,
                            extra_keys=[("salt",), None], group_idx=1)
    raw = msgspec.msgpack.encode(Batch023(1.0, [stored, BlockRemoved023([7], "GPU"), AllBlocksCleared023()]))
    events, unknown = decode_batch(raw)
    assert unknown == 0
    assert events[0] == BlockStored((b"\x01" * 32, 7), None, tuple(range(32)), 16, 1, "GPU", (("salt",), None))
    assert events[1] == BlockRemoved((7,), 0, "GPU")
    assert type(events[2]).__name__ == "AllBlocksCleared"


@pytest.mark.parametrize("cls,ours", [("BlockStored", BlockStored023), ("BlockRemoved", BlockRemoved023)])
def test_the_023_classes_here_are_vllm_023s(cls, ours):
    src = Source(fetched("vllm-0.23.0"))
    fields = [n for n, node in src.members("vllm.distributed.kv_events", cls).items()
              if type(node).__name__ == "AnnAssign"]
    assert fields == list(ours.__struct_fields__)
    text = src.module_file("vllm.distributed.kv_events").read_text()
    assert "class KVCacheEvent(\n    msgspec.Struct,\n    array_like=True," in text
