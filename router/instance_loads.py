"""What the router itself counts of each instance's load, from the pick to the end of each part
of a request (router/routing.py's picker weighs it at the next pick).

`LoadCounts` is `InstancePicker`'s half that counts; it reads the picker's `_load` (an
`InstanceLoad` per instance), `pending`, `lookup`, `cost`, `colocated` and `_clock`. The counts are
the router's own, updated as requests start and end: never stale the way a polled engine gauge is
between two polls, and of this router's requests only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from pdcluster.router.pending_blocks import PendingBlocks
    from pdcluster.router.prefill_cost import PrefillCost
    from pdcluster.router.routing import PrefixLookup, Route

I = TypeVar("I")  # noqa: E741  (the instance type)


@dataclass
class InstanceLoad:
    tokens: int = 0
    requests: int = 0  # D: sequences, as vLLM counts them running (a request of n choices is n)
    seconds: float = 0.0  # P: predicted prefill time of its requests (each as predicted when picked)
    local: int = 0  # D: requests it prefills itself, until their first token


class LoadCounts(Generic[I]):
    """The picker's counting half; see the module docstring."""

    # Invariant: each instance's load is the sum over the requests between
    # prefilling()/decoding() entry and exit on it; both return to 0 when idle.
    _load: dict[str, InstanceLoad]
    pending: PendingBlocks | None
    lookup: PrefixLookup | None
    cost: PrefillCost
    colocated: bool
    _clock: Callable[[], float]

    def ended(self, route: Route[I]) -> None:
        """The request is over, however it ended: if P did not finish its prefill, its promise
        is withdrawn."""
        if self.pending is not None:
            self.pending.withdraw(route.prefill.name, route.key)

    @contextlib.contextmanager
    def prefilling(self, route: Route[I], prompt_tokens: int) -> Iterator[None]:
        """P's load while it works on the request: the tokens it will compute. Once P is done,
        its promise waits only for the events."""
        with self._counted(route.prefill.name, prompt_tokens - (route.predicted_p_hit_tokens or 0),
                           route.p_work_s):
            yield
        self._finished(route.prefill.name, route)

    def prefilled(self, cached_tokens: int, prompt_tokens: int, seconds: float, tier_tokens: int = 0,
                  pool_tokens: int = 0) -> None:
        """What a P's engine took for a prefill (`tier_tokens` of its hit loaded from its host tier,
        `pool_tokens` read from a peer's): the cost model learns from it."""
        self.cost.observe(cached_tokens, prompt_tokens, seconds, tier_tokens, pool_tokens)

    @contextlib.contextmanager
    def prefilling_locally(self, route: Route[I]) -> Iterator[None]:
        """D prefilling the request itself, until its first token: one of D's local slots."""
        assert route.local_prefill, "prefilling_locally: the route sends the prefill to P"
        load = self._load[route.decode.name]
        load.local += 1
        # With no disaggregation, D's predicted prefill queue is what the next pick weighs.
        seconds = route.p_work_s if self.colocated else 0.0
        load.seconds += seconds
        try:
            yield
        finally:
            load.local -= 1
            load.seconds = max(0.0, load.seconds - seconds) if load.local else 0.0  # no float residue
        if self.colocated:
            self._finished(route.decode.name, route)

    @contextlib.contextmanager
    def decoding(self, route: Route[I], prompt_tokens: int, max_tokens: int, n: int = 1) -> Iterator[None]:
        """D's load while it holds the request: the KV it must keep, and its n sequences (D runs
        each choice as a request of its own, sharing the prompt's blocks)."""
        with self._counted(route.decode.name, prompt_tokens + n * max_tokens, count=n):
            yield

    def _finished(self, instance: str, route: Route[I]) -> None:
        if self.pending is not None:
            self.pending.finished(instance, route.key, self._clock(), self.lookup.clears(instance),
                                  self.lookup.removals(instance))

    @contextlib.contextmanager
    def _counted(self, name: str, tokens: int, seconds: float = 0.0, count: int = 1) -> Iterator[None]:
        load = self._load[name]
        load.tokens += tokens
        load.requests += count
        load.seconds += seconds
        try:
            yield
        finally:
            load.tokens -= tokens
            load.requests -= count
            load.seconds = max(0.0, load.seconds - seconds) if load.requests else 0.0  # no float residue

    def in_flight(self) -> dict[str, int]:
        return {name: load.requests for name, load in self._load.items()}

    def queued_tokens(self) -> dict[str, int]:
        return {name: load.tokens for name, load in self._load.items()}
