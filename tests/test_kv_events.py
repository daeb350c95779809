"""The KV-event feed (router/kv_events.py) against vLLM's real ZmqEventPublisher, in-process (no engine)."""

from __future__ import annotations

import contextlib
import threading
import time

import msgspec
import pytest
from e2e import free_port

from pdcluster.proto.kv_event_wire import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    engine_kv_events_config,
    feed_endpoints,
)
from pdcluster.proto.spec import parse_spec
from pdcluster.router.kv_events import KvEventFeed
from pdcluster.router.prefix_index import chain_hashes

BS = 4
NAME = "prefill-0"


def family(n: int, blocks: int = 3) -> list[int]:
    """A prompt of `blocks` full blocks, distinct per n."""
    return [1000 * n + t for t in range(blocks * BS)]


def vllm_stored(engine_hashes, parent, tokens):
    from vllm.distributed.kv_events import BlockStored as VStored

    return VStored(block_hashes=list(engine_hashes), parent_block_hash=parent, token_ids=list(tokens),
                   block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=0)


def vllm_removed(engine_hashes):
    from vllm.distributed.kv_events import BlockRemoved as VRemoved

    return VRemoved(block_hashes=list(engine_hashes), medium="GPU", group_idx=0)


def publisher(endpoint: str, replay_endpoint: str, buffer_steps: int = 10_000):
    """vLLM's ZmqEventPublisher; a port its predecessor just closed may take zmq's I/O thread a
    moment to release, as when an engine restarts."""
    import zmq
    from vllm.distributed.kv_events import ZmqEventPublisher

    deadline = time.monotonic() + 5
    while True:
        try:
            return ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                     buffer_steps=buffer_steps, topic="kv")
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Engine:
    """A vLLM ZmqEventPublisher on free ports, publishing as an engine's scheduler does."""

    def __init__(self, pub_port: int, replay_port: int, buffer_steps: int = 10_000):
        self.pub = publisher(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}", buffer_steps)

    def publish(self, *events) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def store_root(self, hash_base: int, tokens: list[int]) -> None:
        """One batch storing a prompt's blocks from the root (engine hashes hash_base, +1, ...)."""
        n = len(tokens) // BS
        self.publish(vllm_stored(range(hash_base, hash_base + n), None, tokens))

    def wait_published(self, timeout: float = 5.0) -> None:
        """Until the publisher thread has sent every batch given to it (its replay buffer holds them)."""
        deadline = time.monotonic() + timeout
        while self.pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.pub._event_queue.unfinished_tasks, "the publisher did not send its batches"

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def ports():
    return free_port(), free_port()


@pytest.fixture
def engine(ports):
    e = Engine(*ports)
    yield e
    e.close()


def feed_for(ports, **kw) -> KvEventFeed:
    pub, replay = ports
    return KvEventFeed({NAME: (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")}, BS, **{"curve": None, **kw})


def matched(feed: KvEventFeed, prompt: list[int]) -> int:
    return feed.matched_blocks(NAME, chain_hashes(prompt, BS))


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


def test_stop_ends_the_thread_and_closes_the_sockets(engine, ports):
    feed = feed_for(ports).start()
    feed.wait_for(NAME, lambda s: s.connected)
    feed.stop()  # its zmq context terminates only once every socket is closed
    assert not [t for t in threading.enumerate() if t.name == "kv-event-feed"]
    with pytest.raises(AssertionError, match="not running"):
        feed.catch_up()
    feed.stop()  # twice is harmless


def test_without_a_replay_endpoint_a_gap_is_lost_at_once(engine, ports):
    a = family(1)
    pub, _ = ports
    dropped: list[int] = []
    with KvEventFeed({NAME: (f"tcp://127.0.0.1:{pub}", None)}, BS, curve=None,
                     drop=lambda name, seq: seq in dropped) as feed:
        feed.wait_for(NAME, lambda s: s.connected)
        # Until PUB has the subscription it sends nothing (and nothing can be replayed): probe.
        probes = 0
        while feed.status(NAME).applied_seq is None:
            assert probes < 50, "the feed never got a probe batch"
            engine.store_root(90, family(9))
            probes += 1
            with contextlib.suppress(TimeoutError):
                feed.wait_for(NAME, lambda s: s.applied_seq is not None, timeout=0.2)
        # The first probes seen may not be batch 0 (a loss already): an emptied engine cache
        # makes the index exact again, from batch `probes` on.
        from vllm.distributed.kv_events import AllBlocksCleared

        engine.publish(AllBlocksCleared())
        engine.store_root(90, family(9))
        before = feed.wait_for(NAME, lambda s: s.applied_seq == probes + 1)
        assert (before.stale, before.blocks) == (False, 3)
        dropped.append(probes + 3)
        engine.store_root(10, a[:BS])
        engine.publish(vllm_stored([11], 10, a[BS:2 * BS]))  # lost, and no replay to ask
        engine.store_root(20, family(2))
        s = feed.wait_for(NAME, lambda s: s.applied_seq == probes + 4)
        assert (s.stale, s.lost - before.lost, s.replayed, s.blocks) == (True, 1, 0, 3)
        assert (matched(feed, family(9)), matched(feed, a), matched(feed, family(2))) == (0, 0, 3)


def test_a_malformed_endpoint_fails_start_and_leaves_nothing_running():
    feed = KvEventFeed({NAME: ("not-an-endpoint", None)}, BS, curve=None)
    with pytest.raises(RuntimeError, match="failed to start"):
        feed.start()
    assert not [t for t in threading.enumerate() if t.name == "kv-event-feed"]
    feed.stop()  # nothing left to stop


def test_unknown_instance_is_named():
    feed = KvEventFeed({NAME: ("tcp://127.0.0.1:1", None)}, BS, curve=None)
    with pytest.raises(KeyError, match="no KV-event feed for instance 'decode-9'"):
        feed.matched_blocks("decode-9", [])


def test_engines_bind_and_advertise_their_node_address_and_the_feed_dials_it():
    from pdcluster.proto.messages import InstanceInfo
    from pdcluster.transfer.network import InstanceAddress, instance_planes

    spec = parse_spec({"name": "c", "model": {"path": "/m", "name": "tiny"},
                       "prefill": {"instances": 2}, "decode": {"instances": 1},
                       "transfer": {"base_port": 19000}, "router": {"kv_events_port": 18800}})
    cfg = engine_kv_events_config(spec, "decode", 0, "10.0.0.7")
    assert cfg == dict(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://10.0.0.7:18804",
                       replay_endpoint="tcp://10.0.0.7:18805", topic="kv")  # no wildcard
    # bind_all: the sockets bind every interface, the instance advertises its chosen address
    planes = instance_planes(InstanceAddress("0.0.0.0", "10.0.0.7"), "10.0.0.7:4000", spec.kv_event_ports("decode", 0))
    assert (planes.kv_events, planes.kv_events_replay) == ("tcp://10.0.0.7:18804", "tcp://10.0.0.7:18805")
    info = InstanceInfo("decode-0", "decode", 0, "10.0.0.7", 1, None, "c-decode-0", 0.0, planes=planes)
    assert feed_endpoints([info]) == {"decode-0": ("tcp://10.0.0.7:18804", "tcp://10.0.0.7:18805")}


def test_a_curve_publisher_feeds_only_the_cluster():
    """The simulated engine's publisher with the cluster's keys (as every engine publishes):
    a feed with them follows it; a plain feed and one of another secret never connect."""
    from pdcluster.cluster.sim.kv_wire import AllBlocksCleared as SimCleared
    from pdcluster.cluster.sim.kv_wire import EventPublisher
    from pdcluster.cluster.sim.kv_wire import KVEventBatch as SimBatch
    from pdcluster.transfer.auth import curve_keys, zmq_stop_auth

    keys = curve_keys("kv-events-test-secret-0123")
    pub, replay = free_port(), free_port()
    publisher = EventPublisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv", curve=keys)
    endpoints = {NAME: (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")}
    try:
        publisher.publish(SimBatch(ts=0.0, events=[SimCleared()]))
        with KvEventFeed(endpoints, BS, curve=keys, replay_timeout_s=0.5) as good, \
                KvEventFeed(endpoints, BS, curve=None, replay_timeout_s=0.5) as plain, \
                KvEventFeed(endpoints, BS, curve=curve_keys("another-cluster-secret"), replay_timeout_s=0.5) as other:
            good.wait_for(NAME, lambda st: st.connected and st.applied_seq == 0, timeout=10)
            publisher.publish(SimBatch(ts=0.0, events=[SimCleared()]))
            good.wait_for(NAME, lambda st: st.applied_seq == 1, timeout=10)
            for feed in (plain, other):
                status = feed.status(NAME)
                assert not status.connected and status.batches == 0, status
    finally:
        publisher.shutdown()
        import zmq

        zmq_stop_auth(zmq.Context.instance())