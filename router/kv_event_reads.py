"""What the KV-event feed's readers ask of the instances' prefix indexes, from any thread.

`FeedReads` is `KvEventFeed`'s half that reads (router/kv_events.py): the routing's
`PrefixLookup` (router/routing.py), the status and metrics readers, and tests waiting on a
condition. Every read takes the feed's lock; it reads the feed's `_inst` (InstanceFeed per
instance, router/kv_event_order.py), `_lock`, `_changed` (a Condition on it, notified after every
change) and `block_size`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcluster.router.kv_event_order import InstanceFeed
from pdcluster.router.prefix_index import InstanceIndex, RouterHash


@dataclass(frozen=True)
class FeedStatus:
    """One instance as the feed sees it (a snapshot)."""

    instance: str
    connected: bool  # connected, and the history its replay buffer held is applied
    applied_seq: int | None  # the last batch applied; None: none since the last (re)connection
    stale: bool
    blocks: int  # engine blocks the index holds
    removed_blocks: int  # blocks it held that the engine evicted, in all (this index's life)
    batches: int  # batches applied, from the SUB socket or replay
    replayed: int  # of those, batches that came by replay
    lost: int  # times batches were lost for good (the index cleared and stale)
    connections: int  # connections made (each one rebuilt the index from replay)
    skipped_events: int  # events the index could not use, or of an unknown kind
    errors: int  # batches that failed to decode or apply (counted in `lost` too)


class FeedReads:
    """The feed's readers; see the module docstring."""

    block_size: int
    _inst: dict[str, InstanceFeed]
    _lock: threading.Lock
    _changed: threading.Condition


    @property
    def instances(self) -> list[str]:
        return list(self._inst)

    def _get(self, instance: str) -> InstanceFeed:
        try:
            return self._inst[instance]
        except KeyError:
            raise KeyError(f"no KV-event feed for instance {instance!r}; feeds: {sorted(self._inst)}") from None

    def matched_blocks(self, instance: str, hashes: Sequence[RouterHash]) -> int:
        """How many leading blocks of a prompt (its chain_hashes) `instance` holds, as far as
        its events say (0 for what the feed does not know)."""
        st = self._get(instance)
        with self._lock:
            return st.index.matched_blocks(hashes)

    def tier_matched_blocks(self, instance: str, hashes: Sequence[RouterHash], start: int) -> int:
        st = self._get(instance)
        with self._lock:
            return st.index.tier_matched_blocks(hashes, start)

    def matched_tokens(self, instance: str, hashes: Sequence[RouterHash]) -> int:
        return self.matched_blocks(instance, hashes) * self.block_size

    def tier_blocks(self, instance: str) -> tuple[int, int]:
        """`instance`'s host KV tier as its events say: (blocks held, blocks evicted)."""
        st = self._get(instance)
        with self._lock:
            host = st.index.host
            return (len(host), host.removed_blocks) if host is not None else (0, 0)

    def held_blocks(self, instance: str) -> int:
        """How many blocks `instance`'s prefix cache holds, as far as its events say."""
        st = self._get(instance)
        with self._lock:
            return len(st.index)

    def holds(self, instance: str, block: RouterHash) -> bool:
        st = self._get(instance)
        with self._lock:
            return st.index.holds(block)

    def stale(self, instance: str) -> bool:
        st = self._get(instance)
        with self._lock:
            return st.index.stale

    def clears(self, instance: str) -> int:
        """How many times the instance's index was emptied (router/prefix_index.py `clears`)."""
        st = self._get(instance)
        with self._lock:
            return st.index.clears

    def removals(self, instance: str) -> int:
        st = self._get(instance)
        with self._lock:
            return st.index.removed_blocks

    def removed_since(self, instance: str, block: RouterHash, removals: int) -> bool:
        st = self._get(instance)
        with self._lock:
            return st.index.removed_since(block, removals)

    def applied_seq(self, instance: str) -> int | None:
        st = self._get(instance)
        with self._lock:
            return None if st.index.next_seq in (None, 0) else st.index.next_seq - 1

    def status(self, instance: str) -> FeedStatus:
        self._get(instance)
        with self._lock:
            return self._status(instance)

    def _status(self, instance: str) -> FeedStatus:  # under the lock
        st = self._inst[instance]
        idx = st.index
        return FeedStatus(st.name, st.connected, None if idx.next_seq in (None, 0) else idx.next_seq - 1,
                          idx.stale, len(idx), idx.removed_blocks, st.batches, st.replayed, st.lost, st.connections,
                          idx.skipped_events + st.unknown, st.errors)

    def index(self, instance: str) -> InstanceIndex:
        """The instance's index itself: read it under `locked()` while the feed runs."""
        return self._get(instance).index

    def locked(self) -> threading.Lock:
        return self._lock

    def wait_for(self, instance: str, predicate: Callable[[FeedStatus], bool], timeout: float = 10.0) -> FeedStatus:
        """Blocks until `predicate(status(instance))` holds (checked after every change); returns
        that status. Raises TimeoutError with the last status otherwise."""
        self._get(instance)
        with self._changed:
            ok = self._changed.wait_for(lambda: predicate(self._status(instance)), timeout)
            last = self._status(instance)
        if not ok:
            raise TimeoutError(f"{instance}: condition not reached within {timeout} s; last {last}")
        return last

