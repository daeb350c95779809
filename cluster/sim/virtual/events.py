"""The virtual clock: a heap of timed callbacks, run in time order.

Ties are broken so that the order never depends on how many events were pushed before:
at one time, what comes from outside an instance (an arrival, a load's end, a release:
`EXTERNAL`) runs before instances' step ends (`STEP`), which run in instance order; among
external events, the one pushed first runs first. So an arrival at the very nanosecond a
step ends is seen by the next step's schedule, as it would be if it came a moment earlier.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

EXTERNAL, STEP = 0, 1
# Where virtual time starts: records read a timestamp of 0 as "not recorded" (router/recording.py).
ORIGIN_NS = 1_000_000_000


class EventLoop:
    def __init__(self, origin_ns: int = ORIGIN_NS):
        self.origin_ns = self.now_ns = origin_ns
        self._heap: list[tuple[int, int, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0  # callbacks run, in all

    def now_s(self) -> float:
        return self.now_ns / 1e9

    def at(self, t_ns: int, fn: Callable[[], None], kind: int = EXTERNAL, order: int = 0) -> None:
        """Run fn at t_ns (not before now). `kind`/`order`: the tie-breakers of the module docstring."""
        assert t_ns >= self.now_ns, f"an event at {t_ns} ns scheduled at {self.now_ns} ns: in the past"
        heapq.heappush(self._heap, (t_ns, kind, order, next(self._seq), fn))

    def run(self) -> None:
        heap = self._heap
        while heap:
            t_ns, _, _, _, fn = heapq.heappop(heap)
            self.now_ns = t_ns
            self.events += 1
            fn()
