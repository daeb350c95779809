"""kv_wire restates the pieces of vLLM 0.32 the simulated engine needs (so its processes do not
import vLLM): each is checked here against vLLM's own."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq
from e2e import free_port
from vllm.distributed import kv_events as vllm_events
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

from pdcluster.cluster.sim import kv_wire


def test_block_hash_is_vllms_hash_block_tokens_with_its_default_hash():
    init_none_hash(sha256)
    rng = random.Random(0)
    parent = None
    for _ in range(5):
        tokens = [rng.randrange(150_000) for _ in range(128)]
        ours = kv_wire.block_hash(parent, tokens)
        assert ours == hash_block_tokens(sha256, parent, tokens)
        assert kv_wire.external_hash(ours) == maybe_convert_block_hash(ours)
        parent = ours


def test_events_encode_byte_for_byte_as_vllms():
    def batch(m):
        return m.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
            m.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                          lora_id=None, medium="GPU", lora_name=None, group_idx=0),
            m.BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[9] * 4, block_size=4, lora_id=None,
                          medium="GPU", lora_name=None, group_idx=0),
            m.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0),
            m.AllBlocksCleared()])

    ours, theirs = msgspec.msgpack.encode(batch(kv_wire)), msgspec.msgpack.encode(batch(vllm_events))
    assert ours == theirs
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(ours)
    assert [type(e).__name__ for e in decoded.events] == ["BlockStored", "BlockStored", "BlockRemoved",
                                                          "AllBlocksCleared"]


@pytest.mark.parametrize("impl", ["ours", "vllm"])
def test_publisher_speaks_zmq_event_publishers_protocol(impl):
    """The same client exchange against both publishers: live batches, then a replay."""
    pub_port, replay_port = free_port(), free_port()
    if impl == "ours":
        publisher = kv_wire.EventPublisher(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic="kv",
                                           curve=None)
        batch_cls = kv_wire.KVEventBatch
    else:
        publisher = vllm_events.ZmqEventPublisher(0, f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                                                  topic="kv")
        batch_cls = vllm_events.KVEventBatch
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # a SUB misses what is published before it joined
    try:
        for i in range(3):
            publisher.publish(batch_cls(ts=float(i), events=[]))
        live = [sub.recv_multipart() for _ in range(3)]
        assert [(t, int.from_bytes(s, "big")) for t, s, _ in live] == [(b"kv", 0), (b"kv", 1), (b"kv", 2)]
        assert msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(live[2][2]).ts == 2.0
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replay = [dealer.recv_multipart() for _ in range(3)]
        dealer.close(linger=0)
        assert [int.from_bytes(f[2], "big", signed=True) for f in replay] == [1, 2, -1]
        assert replay[0][1] == b"kv" and replay[-1][1:] == [b"", kv_wire.END_SEQ, b""]
    finally:
        sub.close(linger=0)
        publisher.shutdown()
