"""The KV-event feed (router/kv_events.py) and its sockets: stopping, no replay endpoint, bad
endpoints, unknown instances, the node's own addresses, and CURVE keeping other publishers out."""

from __future__ import annotations

import contextlib
import threading

import pytest
from e2e import free_port
from kv_event_fakes import (
    BS,
    NAME,
    family,
    feed_for,
    matched,
    vllm_stored,
)

from pdcluster.proto.kv_event_wire import (
    engine_kv_events_config,
    feed_endpoints,
)
from pdcluster.proto.spec import parse_spec
from pdcluster.router.kv_events import KvEventFeed


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