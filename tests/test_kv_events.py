"""The KV-event feed (router/kv_events.py) against vLLM's real ZmqEventPublisher, in-process (no engine)."""

from __future__ import annotations

import msgspec
import pytest
from e2e import free_port
from kv_event_fakes import (
    BS,
    NAME,
    Engine,
    family,
    feed_for,
    matched,
    publisher,
    vllm_removed,
    vllm_stored,
)

from pdcluster.proto.kv_event_wire import (
    BlockRemoved,
    BlockStored,
    decode_batch,
)
from pdcluster.router.kv_events import KvEventFeed
from pdcluster.router.prefix_index import chain_hashes


def test_decode_batch_reads_vllms_encoding():
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

    stored = vllm_stored([b"\x01" * 32, 7], None, range(2 * BS))
    stored.extra_keys, stored.group_idx = [("salt",), None], 1
    raw = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=[stored, vllm_removed([7]), AllBlocksCleared()]))
    events, unknown = decode_batch(raw)
    assert unknown == 0
    assert events[0] == BlockStored((b"\x01" * 32, 7), None, tuple(range(2 * BS)), BS, 1, "GPU", (("salt",), None))
    assert events[1] == BlockRemoved((7,), 0, "GPU")
    assert type(events[2]).__name__ == "AllBlocksCleared"


def test_decode_batch_counts_unknown_event_kinds_and_rejects_garbage():
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "x": 1}, {"type": "AllBlocksCleared"}], 0])
    events, unknown = decode_batch(raw)
    assert (len(events), unknown) == (1, 1)
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1not msgpack")


def test_batches_are_applied_in_order(engine, ports):
    a = family(1)
    with feed_for(ports) as feed:
        feed.wait_for(NAME, lambda s: s.connected)
        engine.store_root(10, a[:2 * BS])
        engine.publish(vllm_stored([12], 11, a[2 * BS:]))  # its parent is the previous batch's
        engine.publish(vllm_removed([12]))
        engine.wait_published()
        feed.catch_up()
        s = feed.status(NAME)
        assert (s.applied_seq, s.stale, s.lost, s.blocks, s.removed_blocks) == (2, False, 0, 2, 1)
        assert matched(feed, a) == 2
        assert feed.matched_tokens(NAME, chain_hashes(a, BS)) == 2 * BS
        assert feed.held_blocks(NAME) == 2


def test_a_gap_is_filled_from_replay(engine, ports):
    a = family(1)
    with feed_for(ports, drop=lambda name, seq: seq == 1) as feed:
        feed.wait_for(NAME, lambda s: s.connected)
        engine.store_root(10, a[:BS])
        engine.publish(vllm_stored([11], 10, a[BS:2 * BS]))  # lost on the way: only replay has it
        engine.publish(vllm_stored([12], 11, a[2 * BS:]))
        s = feed.wait_for(NAME, lambda s: s.applied_seq == 2)
        assert (s.stale, s.lost, s.blocks) == (False, 0, 3) and s.replayed >= 1
        assert matched(feed, a) == 3


def test_a_lost_last_batch_is_found_when_the_engine_goes_quiet(engine, ports):
    a = family(1)
    with feed_for(ports, drop=lambda name, seq: seq == 1, quiet_probe_s=0.2) as feed:
        feed.wait_for(NAME, lambda s: s.connected)
        engine.store_root(10, a[:BS])
        engine.publish(vllm_stored([11, 12], 10, a[BS:]))  # lost, and nothing comes after it
        s = feed.wait_for(NAME, lambda s: s.applied_seq == 1, timeout=5)
        assert (s.stale, s.lost, s.blocks) == (False, 0, 3) and s.replayed >= 1
        assert matched(feed, a) == 3


def test_a_gap_beyond_the_replay_buffer_makes_the_index_stale(ports):
    engine = Engine(*ports, buffer_steps=2)
    try:
        with feed_for(ports, drop=lambda name, seq: 1 <= seq <= 4) as feed:
            feed.wait_for(NAME, lambda s: s.connected)
            for n in range(6):  # batch n stores family(n) from the root
                engine.store_root(10 * n, family(n))
            engine.wait_published()
            s = feed.wait_for(NAME, lambda s: s.applied_seq == 5)
            # Batches 1-3 are gone from the buffer (it keeps 4 and 5): cleared, stale, then 4 and 5 applied.
            assert (s.stale, s.lost, s.blocks) == (True, 1, 6)
            assert [matched(feed, family(n)) for n in range(6)] == [0, 0, 0, 0, 3, 3]
            # A cleared engine cache is known exactly again.
            from vllm.distributed.kv_events import AllBlocksCleared

            engine.publish(AllBlocksCleared())
            s = feed.wait_for(NAME, lambda s: s.applied_seq == 6)
            assert (s.stale, s.blocks) == (False, 0)
    finally:
        engine.close()


def test_a_feed_started_late_learns_the_history_from_replay(engine, ports):
    for n in range(3):
        engine.store_root(10 * n, family(n))
    engine.wait_published()  # before anyone subscribed: only the replay buffer has them
    with feed_for(ports) as feed:
        s = feed.wait_for(NAME, lambda s: s.applied_seq == 2)
        assert (s.stale, s.lost, s.replayed, s.blocks) == (False, 0, 3, 9)
        assert [matched(feed, family(n)) for n in range(3)] == [3, 3, 3]


def test_a_restarted_engine_clears_the_index_and_numbering_starts_over(ports):
    first = Engine(*ports)
    with feed_for(ports) as feed:
        try:
            feed.wait_for(NAME, lambda s: s.connected)
            for n in range(3):
                first.store_root(10 * n, family(n))
            first.wait_published()
            feed.catch_up()
            assert feed.status(NAME).applied_seq == 2
        finally:
            first.close()
        s = feed.wait_for(NAME, lambda s: not s.connected)
        assert s.blocks == 0  # the engine is gone, and its cache with it
        second = Engine(*ports)
        try:
            second.store_root(50, family(5))
            second.wait_published()
            feed.wait_for(NAME, lambda s: s.connected)
            feed.catch_up()
            s = feed.status(NAME)
            assert (s.applied_seq, s.stale, s.lost, s.connections, s.blocks) == (0, False, 0, 2, 3)
            assert [matched(feed, family(n)) for n in (0, 1, 2, 5)] == [0, 0, 0, 3]
        finally:
            second.close()


def test_redial_follows_an_instance_restarted_elsewhere_and_drops_the_old_one(ports):
    """Ray restarted the instance on another node: new endpoints. The old engine (here still
    publishing, as a host cut off but alive would) is no longer heard."""
    old, new_ports = Engine(*ports), (free_port(), free_port())
    new = Engine(*new_ports)
    with feed_for(ports) as feed:
        try:
            feed.wait_for(NAME, lambda s: s.connected)
            for n in range(3):
                old.store_root(10 * n, family(n))
            old.wait_published()
            feed.catch_up()
            assert [matched(feed, family(n)) for n in range(3)] == [3, 3, 3]
            new.store_root(50, family(5))
            new.wait_published()
            assert feed.redial(NAME, *(f"tcp://127.0.0.1:{p}" for p in new_ports)).wait(10)
            feed.wait_for(NAME, lambda s: s.connected and s.connections == 2)
            old.store_root(70, family(7))  # after the switch: not this instance's any more
            old.wait_published()
            feed.catch_up()
            s = feed.status(NAME)
            assert (s.applied_seq, s.stale, s.lost, s.blocks) == (0, False, 0, 3)
            assert [matched(feed, family(n)) for n in (0, 1, 2, 5, 7)] == [0, 0, 0, 3, 0]
            assert feed.redial(NAME, *(f"tcp://127.0.0.1:{p}" for p in new_ports)).is_set()  # same: nothing to do
        finally:
            old.close()
            new.close()


def test_a_numbering_that_goes_back_is_a_restart_even_on_one_connection():
    """Engines behind a broker (XSUB/XPUB): the feed's connection outlives the engine, so only
    the numbering says a new engine (empty cache) took over."""
    import zmq
    from zmq.devices import ThreadProxy

    upstream, downstream, replay = free_port(), free_port(), free_port()
    broker = ThreadProxy(zmq.XSUB, zmq.XPUB)
    broker.bind_in(f"tcp://127.0.0.1:{upstream}")
    broker.bind_out(f"tcp://127.0.0.1:{downstream}")
    broker.start()

    def engine_behind_broker():
        e = Engine.__new__(Engine)  # connects its PUB to the broker (vLLM connects a non-wildcard endpoint)
        e.pub = publisher(f"tcp://127.0.0.1:{upstream}", f"tcp://127.0.0.1:{replay}")
        return e

    def publish_until(e, hash_base, tokens, blocks):
        # A PUB that just connected has not got the subscription yet: publish the same blocks
        # again (idempotent) until the index holds `blocks`.
        for _ in range(50):
            e.store_root(hash_base, tokens)
            try:
                return feed.wait_for(NAME, lambda s: s.blocks == blocks, timeout=0.2)
            except TimeoutError:
                pass
        raise AssertionError(f"the index never held {blocks} blocks")

    with KvEventFeed({NAME: (f"tcp://127.0.0.1:{downstream}", f"tcp://127.0.0.1:{replay}")}, BS, curve=None) as feed:
        feed.wait_for(NAME, lambda s: s.connected)
        first = engine_behind_broker()
        try:
            publish_until(first, 0, family(0), 3)
            for n in range(1, 12):  # a history longer than the second engine's will be when seen
                first.store_root(10 * (n % 4), family(n % 4))
            first.wait_published()
            feed.catch_up()
            s = feed.status(NAME)
            assert (s.blocks, s.stale, s.lost) == (12, False, 0) and s.applied_seq >= 11
        finally:
            first.close()
        second = engine_behind_broker()
        try:
            s = publish_until(second, 50, family(5), 3)
            assert (s.connected, s.connections, s.stale, s.lost) == (True, 1, False, 0)
            assert s.applied_seq < 11  # the new engine's numbering
            assert [matched(feed, family(n)) for n in (0, 1, 2, 3, 5)] == [0, 0, 0, 0, 3]
        finally:
            second.close()
