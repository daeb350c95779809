"""vLLM's prefix-cache block hash and KV-cache-event wire format, without importing vLLM.

`import vllm` costs a process ~8 CPU-seconds and ~300 MB (it pulls in
torch._inductor and transformers); a P8+D8 simulated cluster is 16 such
processes on this 2-core, 24 GB machine, and its instances need only a few
pieces of vLLM. Those pieces are restated here, each pinned to vLLM 0.32 by
tests/test_sim_kv_wire.py, which compares them with vLLM's own:

- `block_hash(parent, tokens)`: vllm.v1.core.kv_cache_utils.hash_block_tokens
  with the default `prefix_caching_hash_algo` (sha256 of the pickled
  (parent, tokens, extra_keys=None)); the first block's parent is NONE_HASH,
  sha256 of PYTHONHASHSEED if set, else of "vllm-none-hash" (vLLM's
  resolve_none_hash_seed for a cryptographic hash);
- `external_hash(h)`: maybe_convert_block_hash, the hash as events carry it
  (the low 64 bits of the big-endian int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0);
- `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`: msgspec
  structs encoding exactly as vllm.distributed.kv_events' (tagged by class
  name, fields by name, defaults omitted; the batch as an array);
- `EventPublisher`: ZmqEventPublisher's protocol: a PUB socket sending
  (topic, seq as 8-byte big-endian, msgpack batch), and a ROUTER answering a
  replay request (client, b"", start seq) with every buffered batch from
  there, then (client, b"", b"", seq -1, b"").
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import queue
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from pdcluster.transfer.auth import CurveKeys, zmq_secure_server

log = logging.getLogger(__name__)

BlockHash = bytes
ExternalBlockHash = bytes | int
MEDIUM_GPU = "GPU"


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> BlockHash:
    """The parent of a prompt's first block (read at call time: PYTHONHASHSEED may change in tests)."""
    return _sha256(os.getenv("PYTHONHASHSEED", "vllm-none-hash"))


NONE_HASH = none_hash()


def block_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    return _sha256((parent or NONE_HASH, tuple(tokens), None))


def external_hash(h: BlockHash) -> ExternalBlockHash:
    return external_hashes([h])[0]


def int_block_hashes() -> bool:
    """Whether events carry hashes as ints (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, default on)."""
    return os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


def external_hashes(hashes: Sequence[BlockHash], as_int: bool | None = None) -> list[ExternalBlockHash]:
    """external_hash of each. `as_int`: int_block_hashes(), if the caller read it already (a
    block pool reads it once, not at every step)."""
    if not (int_block_hashes() if as_int is None else as_int):
        return list(hashes)
    mask = (1 << 64) - 1
    return [int.from_bytes(h, byteorder="big") & mask for h in hashes]


# ---- events: the same names, fields and struct options as vllm.distributed.kv_events

class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# ---- the publisher

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    """One thread owns both sockets (ZMQ sockets are not thread-safe); `publish` only queues."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "", buffer_steps: int = 10_000,
                 hwm: int = 100_000, data_parallel_rank: int = 0, *, curve: CurveKeys | None):
        """`curve`: serve only the cluster's processes (CURVE, transfer/auth.py), as the engines'
        patched vLLM publisher does; None only for tests of the wire format."""
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if curve is not None:
            zmq_secure_server(self._pub, curve, f"KV events at {endpoint}")
        # Bound, as the engines' patched vLLM publisher binds it (vLLM itself connects a PUB
        # endpoint that is not a wildcard).
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            if curve is not None:
                zmq_secure_server(self._replay, curve, f"KV-event replay at {replay_endpoint}")
            self._replay.bind(replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="sim-kv-events")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if not self._running:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        self._queue.put(batch)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001  (replay is best effort, as in vLLM)
                    log.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if batch is None:
                break
            payload = encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            log.warning("invalid KV event replay request: %s", frame)
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=2.0)
