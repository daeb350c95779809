"""Prompt blocks the router has sent to an instance whose KV events have not come yet.

The KV-event feed (router/kv_events.py) learns what an instance holds only after it
computed (P) or received (D) the blocks: a new 128K prefix takes seconds to prefill,
and every request of its family arriving meanwhile would see no instance holding it.
vllm-router's cache_aware and SGLang's router insert a prefix into their tree when they
route it; Dynamo's KV router tracks blocks routed but not yet seen stored. Here the
router does both: the feed's index stays exactly what the events say (confirmed), and
this module holds what is promised (pending), apart.

Contract, per instance (a P or a D):
- `add(instance, key, hashes)`: the router has just sent request `key` there; the
  prompt's hittable blocks (`hittable_hashes`) are pending on it at once.
- `withdraw(instance, key)`: the request failed or was aborted before that instance
  finished its part; its blocks will not come (those another pending request also
  promises stay pending). A part already finished stands (P prefilled, then D failed:
  P holds the blocks), so withdrawing everything a failed request touched is right.
- `finished(instance, key, now)`: it ended well (P: its prefill). Its events are about
  to confirm the blocks (an engine publishes a step's batch before that step's outputs
  leave it). From then on, `settle(instance, now, clears, holds)` drops the promise:
  - confirmed, as soon as the instance's index holds its last block (a chain's last
    block covers all before it);
  - evicted, once the index saw its last block removed after it finished (`evicted`): stored
    and evicted again between two lookups, under memory pressure;
  - void, once the instance's cache was emptied since (a reset, a restart: the
    index's `clears` count moved on), its blocks gone with the rest;
  - expired, `grace_s` after, if the events never confirmed it.
  After that only the events count, evictions included. Running promises stand.
- `pending_blocks(instance, hashes, start)`: how many of a prompt's blocks from
  `start` on are pending there (each block of a chain covers all before it, so a run).
Time comes from the caller (`now`, monotonic seconds), so tests need no clock.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pdcluster.router.prefix_index import RouterHash

GRACE_S = 2.0  # after a request ended well, how long its blocks may wait for their events


@dataclass
class _Promise:
    hashes: tuple[RouterHash, ...]
    done_at: float | None = None  # when its request ended well; None: still running
    clears: int = 0  # the instance's clears count when it finished
    removals: int = 0  # the instance's removed-blocks count when it finished


@dataclass
class PendingCounts:
    """What the promises of one instance amount to (for /metrics and tests)."""

    requests: int = 0  # requests whose blocks are pending
    blocks: int = 0  # distinct blocks pending
    withdrawn: int = 0  # promises withdrawn (failure or abort), in all
    expired: int = 0  # promises dropped unconfirmed after their request ended well (or voided by a clear)
    confirmed: int = 0  # promises the instance's events confirmed, in all
    evicted: int = 0  # promises whose blocks the events showed stored and evicted again, in all


@dataclass
class _InstancePending:
    # Invariant: _count[h] == the number of promises in _promises whose hashes contain h, and
    # no entry is 0 (absent instead). A Counter: a promise's blocks are counted in one call (in C).
    _promises: dict[Hashable, _Promise] = field(default_factory=dict)
    _count: Counter[RouterHash] = field(default_factory=Counter)
    withdrawn: int = 0
    expired: int = 0
    confirmed: int = 0
    evicted: int = 0

    def add(self, key: Hashable, hashes: Sequence[RouterHash]) -> None:
        assert key not in self._promises, f"request {key!r} promised twice on one instance: reuse of a route key"
        promise = _Promise(tuple(dict.fromkeys(hashes)))  # a prompt may repeat a block: count it once
        self._promises[key] = promise
        self._count.update(promise.hashes)

    def drop(self, key: Hashable) -> bool:
        promise = self._promises.pop(key, None)
        if promise is None:
            return False
        for h in promise.hashes:
            n = self._count[h] - 1
            if n:
                self._count[h] = n
            else:
                self._count.pop(h)  # (not del: a Counter's __delitem__ is Python)
        return True


class PendingBlocks:
    """Every instance's pending blocks; see the module docstring. Not thread-safe: the
    router's event loop is its only user."""

    def __init__(self, grace_s: float = GRACE_S):
        assert grace_s >= 0, f"grace_s {grace_s}: must not be negative"
        self.grace_s = grace_s
        self._inst: dict[str, _InstancePending] = {}

    def _of(self, instance: str) -> _InstancePending:
        return self._inst.setdefault(instance, _InstancePending())

    def add(self, instance: str, key: Hashable, hashes: Sequence[RouterHash]) -> None:
        if hashes:
            self._of(instance).add(key, hashes)

    def withdraw(self, instance: str, key: Hashable) -> None:
        st = self._of(instance)
        promise = st._promises.get(key)
        if promise is not None and promise.done_at is None and st.drop(key):
            st.withdrawn += 1

    def finished(self, instance: str, key: Hashable, now: float, clears: int = 0, removals: int = 0) -> None:
        """`clears`, `removals`: the instance's index's counts of both now."""
        promise = self._of(instance)._promises.get(key)
        if promise is not None and promise.done_at is None:
            promise.done_at, promise.clears, promise.removals = now, clears, removals

    def settle(self, instance: str, now: float, clears: int = 0, holds: Callable[[RouterHash], bool] | None = None,
               evicted: Callable[[RouterHash, int], bool] | None = None) -> None:
        """Drop the instance's finished promises that are confirmed, evicted, void or past the
        grace. `clears`: its index's clears count now; `holds`: whether its index holds a block;
        `evicted(block, removals)`: whether its index saw the block removed since its removed-blocks
        count was `removals`."""
        st = self._of(instance)
        for key, p in list(st._promises.items()):
            if p.done_at is None:
                continue
            if holds is not None and holds(p.hashes[-1]):
                st.confirmed += 1
            elif evicted is not None and evicted(p.hashes[-1], p.removals):
                st.evicted += 1
            elif p.clears < clears or now - p.done_at >= self.grace_s:
                st.expired += 1
            else:
                continue
            st.drop(key)

    def pending_blocks(self, instance: str, hashes: Sequence[RouterHash], start: int = 0) -> int:
        count = self._inst[instance]._count if instance in self._inst else {}
        return len(list(itertools.takewhile(count.__contains__, itertools.islice(hashes, start, None))))

    def counts(self, instance: str) -> PendingCounts:
        st = self._of(instance)
        return PendingCounts(len(st._promises), len(st._count), st.withdrawn, st.expired, st.confirmed, st.evicted)

    def check_integrity(self) -> None:
        """The invariant of every instance's counts (tests call it)."""
        for name, st in self._inst.items():
            want: dict[RouterHash, int] = {}
            for p in st._promises.values():
                for h in p.hashes:
                    want[h] = want.get(h, 0) + 1
            assert st._count == want, f"{name}: pending block counts drifted from its promises (a drop missed)"
