"""The KV-event feed: every instance's vLLM KV cache events, applied to its prefix index.

What the engines publish, and how it decodes, is proto/kv_event_wire.py; how one
instance's batches are put in order (gaps, replay, restarts), router/kv_event_order.py; what
readers ask of the indexes (any thread), router/kv_event_reads.py.

`KvEventFeed` runs one thread that owns every socket (one SUB and one replay
DEALER per instance, plus a monitor of each SUB's connection). Contract:
- batches are applied in order, each under the feed's lock, to that instance's
  `InstanceIndex` (router/prefix_index.py), whose numbering starts at 0;
- a gap in the numbering is filled from the instance's replay buffer; only if
  the buffer no longer holds the missing batches is the index cleared and
  marked stale (it then holds nothing, relearns from later batches, and is
  trusted again after the engine's cache is cleared or the instance restarts);
- on every (re)connection to an instance (the feed starting late, or a new
  engine behind the same port) the index is rebuilt from that instance's replay
  buffer from batch 0; a numbering that goes back (a restarted engine) likewise
  starts the index over, not stale;
- a lost connection empties the index (whatever the engine held is out of reach);
- a batch lost on the way is found by the next one's number, or, if the engine
  goes quiet, by one replay request `quiet_probe_s` after its last batch;
- `catch_up()` applies everything each instance had published (sent: vLLM's
  publisher queues a batch, then its own thread sends it) when it was called: a
  barrier for tests and tools, never needed for routing. An engine queues a
  step's batch before that step's outputs leave it, so the batch is sent long
  before the response has crossed the actor, the router and HTTP to a client.
Readers (`matched_blocks`, `status`) may call from any thread.

Replay requests are made from the feed's thread and waited for (up to
`replay_timeout_s`): an instance whose replay socket does not answer holds the
other instances' batches back that long, once per gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pdcluster.proto.kv_event_wire import KV_EVENTS_TOPIC
from pdcluster.proto.kv_groups import KvGroup
from pdcluster.router.kv_event_order import REPLAY_TIMEOUT_S, InstanceFeed, OrderedBatches
from pdcluster.router.kv_event_reads import FeedReads
from pdcluster.transfer.auth import CurveKeys, zmq_secure_client

log = logging.getLogger(__name__)

QUIET_PROBE_S = 1.0  # this long after an instance's last batch (or connection), ask its replay once
HANDSHAKE_FAILED = 0x800 | 0x2000 | 0x4000  # zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, _PROTOCOL, _AUTH


# -- the feed ----------------------------------------------------------------------------

class KvEventFeed(FeedReads, OrderedBatches):
    """Follows every instance's KV events into its prefix index; see the module docstring."""

    def __init__(self, endpoints: Mapping[str, tuple[str, str | None]], block_size: int, *,
                 curve: CurveKeys | None, topic: str = KV_EVENTS_TOPIC, replay_timeout_s: float = REPLAY_TIMEOUT_S,
                 quiet_probe_s: float = QUIET_PROBE_S,
                 drop: Callable[[str, int], bool] | None = None,
                 groups: Mapping[str, tuple[KvGroup, ...]] | None = None):
        """`endpoints`: {instance name: (publish endpoint, replay endpoint or None)}, e.g.
        `feed_endpoints(infos)`. `curve`: the cluster's CURVE keys (transfer/auth.py), as the
        engines publish only to the cluster's processes; None only against plain publishers
        (tests of the wire). `drop`: fault injection for tests: SUB messages (instance, seq)
        it returns True for are ignored, as if the network lost them. `groups`: each instance's
        KV-cache groups (InstanceInfo.kv_groups), so that its index counts hits as its engine does."""
        assert endpoints, "a KV-event feed needs at least one instance"
        assert block_size > 0, f"block_size {block_size}: must be positive"
        self.block_size = block_size
        self._topic = topic.encode()
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._quiet_probe_s = quiet_probe_s
        self._drop = drop
        self._curve = curve
        self._inst = {name: InstanceFeed(name, pub, replay, block_size, (groups or {}).get(name, ()))
                      for name, (pub, replay) in endpoints.items()}
        self._lock = threading.Lock()  # guards every index and counter
        self._changed = threading.Condition(self._lock)  # notified after every change of state
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ctx: Any = None
        self._wake_tx: Any = None
        self._wake_lock = threading.Lock()  # the caller-side wake socket is shared by caller threads
        self._commands: list[tuple[str | tuple, threading.Event]] = []  # "catch_up" | ("redial", name, pub, replay)
        self._ready = threading.Event()
        self.failure: BaseException | None = None  # what ended the thread early, if anything

    # -- lifecycle --

    def start(self) -> KvEventFeed:
        import zmq

        assert self._thread is None, "KvEventFeed.start() called twice"
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kv-event-feed", daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the KV-event feed thread did not start"
        if self.failure is not None:
            self._thread.join()
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
            self._ctx.term()
            self._thread = None
            raise RuntimeError(f"the KV-event feed failed to start: {self.failure}") from self.failure
        return self

    def stop(self) -> None:
        """Ends the thread (joined), closes every socket; the indexes stay readable."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the KV-event feed thread did not stop within 10 s"
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        self._ctx.term()
        self._thread = None

    def __enter__(self) -> KvEventFeed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def catch_up(self, timeout: float = 10.0) -> None:
        """Returns once every batch each instance had published at the call is applied."""
        assert self._thread is not None and self._thread.is_alive(), (
            f"catch_up on a KV-event feed that is not running (failure: {self.failure!r})")
        done = threading.Event()
        with self._wake_lock:
            self._commands.append(("catch_up", done))
        self._wake()
        if not done.wait(timeout):
            raise TimeoutError(f"the KV-event feed did not catch up within {timeout} s")

    def redial(self, instance: str, publish: str, replay: str | None) -> threading.Event:
        """Follow `instance` at these endpoints from now on (it restarted on another node): its
        index starts over from the new engine's history, as on any new connection. Returns at
        once (the router's loop calls it), with an event set once the feed's thread switched."""
        st = self._get(instance)
        done = threading.Event()
        if (st.publish, st.replay_endpoint) == (publish, replay):
            done.set()
            return done
        with self._wake_lock:
            self._commands.append((("redial", instance, publish, replay), done))
        self._wake()
        return done

    # -- the thread --

    def _wake(self) -> None:
        with self._wake_lock:
            self._wake_tx.send(b"")

    def _run(self) -> None:
        import zmq

        wake_rx = self._ctx.socket(zmq.PAIR)
        try:
            wake_rx.bind(f"inproc://kv-event-feed-wake-{id(self)}")
            with self._wake_lock:
                self._wake_tx = self._ctx.socket(zmq.PAIR)
                self._wake_tx.connect(f"inproc://kv-event-feed-wake-{id(self)}")
            poller = zmq.Poller()
            poller.register(wake_rx, zmq.POLLIN)
            owner: dict[Any, tuple[str, InstanceFeed]] = {}
            for st in self._inst.values():
                st.sub = self._ctx.socket(zmq.SUB)
                st.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                if self._curve is not None:
                    zmq_secure_client(st.sub, self._curve)
                # Connected means the ZMTP (CURVE) handshake succeeded, not just TCP.
                st.monitor = st.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                                       | HANDSHAKE_FAILED)
                st.sub.connect(st.publish)
                poller.register(st.monitor, zmq.POLLIN)
                poller.register(st.sub, zmq.POLLIN)
                owner[st.monitor], owner[st.sub] = ("monitor", st), ("sub", st)
        except BaseException as e:  # noqa: BLE001 (reported by start(), e.g. a malformed endpoint)
            self.failure = e
            self._close_sockets(wake_rx)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                for sock, _ in poller.poll(self._poll_ms()):
                    if sock is wake_rx:
                        while wake_rx.poll(0):
                            wake_rx.recv()
                        continue
                    kind, st = owner[sock]
                    if kind == "monitor":
                        self._on_monitor(st)
                    else:
                        self._on_sub(st)
                self._run_commands()
                self._probe_quiet()
        except BaseException as e:  # noqa: BLE001 (a bug: keep it for whoever asks)
            log.exception("the KV-event feed thread failed")
            self.failure = e
        finally:
            self._close_sockets(wake_rx)
            self._run_commands(serve=False)  # release any waiter; the sockets are gone

    def _close_sockets(self, wake_rx: Any) -> None:
        """Every socket but the callers' wake socket (stop() closes that one), so the context can end."""
        for st in self._inst.values():
            if st.monitor is not None:
                st.sub.disable_monitor()
            for sock in (st.monitor, st.sub, st.dealer):
                if sock is not None:
                    sock.close(linger=0)
            st.sub = st.monitor = st.dealer = None
        wake_rx.close(linger=0)

    def _run_commands(self, serve: bool = True) -> None:
        with self._wake_lock:
            commands, self._commands = self._commands, []
        for what, done in commands:
            if what == "catch_up" and serve and not self._stopping:
                for st in self._inst.values():
                    if st.connected:
                        self._fill(st, st.index.next_seq or 0)
            elif what[0] == "redial" and serve and not self._stopping:
                self._redial(self._inst[what[1]], *what[2:])
            done.set()

    def _redial(self, st: InstanceFeed, publish: str, replay: str | None) -> None:
        log.info("%s: KV events now from %s (was %s)", st.name, publish, st.publish)
        st.sub.disconnect(st.publish)  # the monitor's DISCONNECTED (if it was up) empties the index
        if st.dealer is not None:
            st.dealer.close(linger=0)
            st.dealer = None
        st.publish, st.replay_endpoint = publish, replay
        st.sub.connect(publish)  # its HANDSHAKE_SUCCEEDED rebuilds the index from the replay

    def _poll_ms(self) -> int:
        due = [st.probe_at for st in self._inst.values() if st.probe_at is not None]
        return 1000 if not due else max(0, min(1000, int((min(due) - time.monotonic()) * 1000) + 1))

    def _probe_quiet(self) -> None:
        """A batch lost on the way shows as a gap when the next one comes; if none comes (the
        engine went quiet), ask the replay buffer once, a while after the last."""
        now = time.monotonic()
        for st in self._inst.values():
            if st.probe_at is not None and now >= st.probe_at:
                st.probe_at = None
                if st.connected:
                    self._fill(st, st.index.next_seq or 0)

    def _on_monitor(self, st: InstanceFeed) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while st.monitor.poll(0):
            event = recv_monitor_message(st.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                # The engine went away (or the network did): what it held is out of reach.
                with self._lock:
                    st.connected = False
                    st.index.restarted()
                    st.index.next_seq = 0
                    self._changed.notify_all()
                st.last_sub_seq = None
            elif event & HANDSHAKE_FAILED:
                if not st.handshake_failed:  # ZMQ retries every 100 ms: say it once until one succeeds
                    log.warning("%s: the KV-event handshake with %s failed (event %#x): its engine holds "
                                "another cluster's secret, or is not an engine", st.name, st.publish, event)
                st.handshake_failed = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                st.handshake_failed = False
                # A first connection, or a new engine behind the port: rebuild from its history.
                # Whatever the SUB socket holds was sent before the replay below answers, so the
                # replay covers it; dropping it keeps an old engine's last batches out.
                while st.sub.poll(0):
                    st.sub.recv_multipart()
                with self._lock:
                    st.index.restarted()
                    st.index.next_seq = 0
                st.last_sub_seq = None
                self._fill(st, 0)
                st.probe_at = time.monotonic() + self._quiet_probe_s  # PUB may not have had the subscription yet
                with self._lock:  # connected: the history is in (status readers may rely on it)
                    st.connected = True
                    st.connections += 1
                    self._changed.notify_all()
