"""One instance's KV-event batches into its prefix index, in order (the feed's thread).

Part of `KvEventFeed` (router/kv_events.py), which owns the sockets and calls these from
its one thread: a batch numbered as expected is applied; one past a gap waits while the
gap is filled from the instance's replay buffer (whatever the buffer no longer holds is
lost: the index is cleared and marked stale); a numbering that goes back is a new
engine, whose index starts over. Every change is made under the feed's lock and
notified on its condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from pdcluster.proto.kv_event_wire import END_SEQ, decode_batch
from pdcluster.proto.kv_groups import KvGroup
from pdcluster.router.prefix_index import InstanceIndex
from pdcluster.transfer.auth import CurveKeys, zmq_secure_client

log = logging.getLogger("pdcluster.router.kv_events")

REPLAY_TIMEOUT_S = 2.0  # the publisher serves replay between queue polls of 0.1 s


class InstanceFeed:
    """Per-instance state; sockets are touched by the feed thread only."""

    def __init__(self, name: str, publish: str, replay: str | None, block_size: int,
                 groups: tuple[KvGroup, ...] = ()):
        self.name, self.publish, self.replay_endpoint = name, publish, replay
        self.index = InstanceIndex(block_size, next_seq=0, groups=groups)  # a new engine numbers from 0
        self.last_sub_seq: int | None = None
        self.connected = False
        self.sub: Any = None
        self.monitor: Any = None
        self.dealer: Any = None
        self.probe_at: float | None = None  # when to ask the replay buffer for what SUB may have lost
        self.handshake_failed = False  # the last handshake with the publisher failed (logged once)
        self.batches = self.replayed = self.lost = self.connections = self.unknown = self.errors = 0


class OrderedBatches:
    """The feed's per-instance ordering; KvEventFeed sets these attributes."""

    _lock: threading.Lock  # guards every index and counter
    _changed: threading.Condition  # notified after every change of state
    _ctx: Any  # the zmq context
    _curve: CurveKeys | None
    _replay_timeout_ms: int
    _quiet_probe_s: float
    _drop: Callable[[str, int], bool] | None

    def _on_sub(self, st: InstanceFeed) -> None:
        import zmq

        for _ in range(1000):  # bounded, so other instances and commands get their turn
            try:
                frames = st.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("%s: a KV-event message of %d frames, not (topic, seq, batch): ignored",
                            st.name, len(frames))
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self._drop is not None and self._drop(st.name, seq):
                continue
            if st.last_sub_seq is not None and seq <= st.last_sub_seq:
                # The numbering went back: a new engine with an empty cache.
                with self._lock:
                    st.index.restarted()
                    st.index.next_seq = 0
            st.last_sub_seq = seq
            st.probe_at = time.monotonic() + self._quiet_probe_s
            expected = st.index.next_seq or 0
            if seq < expected:
                continue  # already applied from a replay
            if seq == expected:
                self._apply(st, seq, payload, replayed=False)
            else:
                self._fill(st, expected, held=(seq, payload))

    def _fill(self, st: InstanceFeed, start: int, held: tuple[int, bytes] | None = None) -> None:
        """Apply batches from `start` on, from the instance's replay buffer (and `held`, a batch
        already in hand); whatever the buffer lacks is lost, and the index says so."""
        got = {seq: payload for seq, payload in self._replay(st, start) if seq >= start}
        replayed = set(got)
        if held is not None:
            got.setdefault(held[0], held[1])
        for seq in sorted(got):
            if seq >= (st.index.next_seq or 0):
                self._apply(st, seq, got[seq], replayed=seq in replayed)

    def _replay(self, st: InstanceFeed, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch from `start` on ([] if the instance has no replay endpoint,
        or it did not answer in time)."""
        import zmq

        if st.replay_endpoint is None:
            return []
        if st.dealer is None:
            st.dealer = self._ctx.socket(zmq.DEALER)
            if self._curve is not None:
                zmq_secure_client(st.dealer, self._curve)
            st.dealer.connect(st.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            st.dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            while st.dealer.poll(self._replay_timeout_ms):
                frames = st.dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_bytes, "big"), payload))
        except zmq.Again:
            pass
        # No end marker in time: a later answer must not be mistaken for the next one's.
        log.warning("%s: no replay answer from %s within %d ms", st.name, st.replay_endpoint,
                    self._replay_timeout_ms)
        st.dealer.close(linger=0)
        st.dealer = None
        return out

    def _apply(self, st: InstanceFeed, seq: int, payload: bytes, replayed: bool) -> None:
        try:
            events, unknown = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("%s: KV-event batch %d does not decode (%s): counted as lost", st.name, seq, e)
            with self._lock:
                st.errors += 1
                st.lost += 1
                st.index.lost_history()
                st.index.next_seq = seq + 1
                self._changed.notify_all()
            return
        with self._lock:
            try:
                contiguous = st.index.apply(seq, events)
            except AssertionError as e:
                log.error("%s: KV-event batch %d does not apply (%s): counted as lost", st.name, seq, e)
                st.errors += 1
                contiguous = False
                st.index.lost_history()
                st.index.next_seq = seq + 1
            st.batches += 1
            st.replayed += replayed
            st.unknown += unknown
            if not contiguous:
                st.lost += 1
                log.warning("%s: KV-event batches before %d are lost: its prefix index starts over (stale)",
                            st.name, seq)
            self._changed.notify_all()
