"""vLLM's KV cache events on the wire: where each instance publishes them, and how a
published batch decodes (vllm/distributed/kv_events.py), read without importing vLLM.

Each engine publishes with vLLM's `ZmqEventPublisher` (kv_events_config, from
`engine_kv_events_config`): batches of BlockStored / BlockRemoved /
AllBlocksCleared as multipart messages (topic, seq as 8-byte big-endian,
msgpack `KVEventBatch`) on a PUB socket, and serves missed batches from a
buffer of its last `buffer_steps` on a ROUTER socket (request: empty frame +
start seq; answer: every buffered batch from there, then an end marker with seq
-1). The simulated engine (cluster/sim) publishes the same way. The feed that
follows them is router/kv_events.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

EngineHash = int | bytes  # vLLM's ExternalBlockHash: bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES


@dataclass(frozen=True)
class BlockStored:
    """vLLM's BlockStored, as the router needs it: engine hashes of consecutive blocks."""

    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]  # all the blocks' tokens, block after block
    block_size: int
    group_idx: int = 0
    medium: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # one per block, or None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: Sequence[EngineHash]
    group_idx: int = 0
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

# The medium of a host-memory tier's blocks (vLLM's CPU offloading names them so; so does P's host
# tier, transfer/tier_scheduler.py); the device pool's are "GPU" or unset, whatever the device.
HOST_MEDIUM = "CPU"

KV_EVENTS_TOPIC = "kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the publisher's end-of-replay marker


# -- where engines publish and where the feed connects ------------------------------------

def engine_kv_events_config(spec: Any, role: str, index: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """vLLM's KVEventsConfig fields for one instance (a ClusterSpec's `router.kv_events_port`),
    both sockets on `host`, the instance's bind address (transfer/network.py). vLLM's own
    publisher would connect, not bind, a PUB endpoint that is not a wildcard: the engines'
    publisher is patched to bind it, with CURVE (cluster/vllm_patches.py, kv_events_curve).
    Any number of feeds (the router, a test, a tool) can follow one engine."""
    pub, replay = spec.kv_event_ports(role, index)
    return dict(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://{host}:{pub}",
                replay_endpoint=f"tcp://{host}:{replay}", topic=KV_EVENTS_TOPIC)


def feed_endpoints(infos: Sequence[Any]) -> dict[str, tuple[str, str]]:
    """{instance name: (publish endpoint, replay endpoint)} for a KvEventFeed of these
    instances (InstanceInfo), as each advertises them."""
    return {i.name: (i.planes.kv_events, i.planes.kv_events_replay) for i in infos}


# -- vLLM's wire format (vllm/distributed/kv_events.py), read without importing vLLM ----------
# Events are tagged maps (unknown fields ignored); the batch is an array [ts, events, dp_rank].

class _WireStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _WireCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


# vLLM 0.23 encodes events as tagged arrays ([tag, field, ...], trailing defaults omitted):
# the same fields, positional, in its declaration order (0.26 moved to tagged maps).
class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(_WireBatch)
_event_decoder = msgspec.msgpack.Decoder(_WireStored | _WireRemoved | _WireCleared)
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
# msgpack's array markers: fixarray, array16, array32 (a map starts 0x80-0x8f, 0xde or 0xdf).
_ARRAY_FIRST_BYTES = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def decode_batch(payload: bytes) -> tuple[list[KvEvent], int]:
    """A published batch as index events, and how many events were of a kind it does not know.
    Raises msgspec.DecodeError / ValidationError for a payload that is not a KVEventBatch."""
    batch = _batch_decoder.decode(payload)
    events: list[KvEvent] = []
    unknown = 0
    for raw in batch.events:
        decoder = _array_event_decoder if bytes(raw)[:1] and bytes(raw)[0] in _ARRAY_FIRST_BYTES else _event_decoder
        try:
            ev = decoder.decode(raw)
        except msgspec.ValidationError:  # a newer vLLM's event type: not ours to guess
            unknown += 1
            continue
        if isinstance(ev, (_WireStored, _ArrayStored)):
            extra = tuple(tuple(k) if k is not None else None for k in ev.extra_keys) if ev.extra_keys else None
            events.append(BlockStored(tuple(ev.block_hashes), ev.parent_block_hash, tuple(ev.token_ids),
                                      ev.block_size, ev.group_idx or 0, ev.medium, extra))
        elif isinstance(ev, (_WireRemoved, _ArrayRemoved)):
            events.append(BlockRemoved(tuple(ev.block_hashes), ev.group_idx or 0, ev.medium))
        else:
            events.append(AllBlocksCleared())
    return events, unknown
