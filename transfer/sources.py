"""P side: the KV each prefill offers to D, and how much of it is ready.

A source is one transfer's KV on P's worker. It appears when P's scheduler first
runs the request (every step, the connector passes the worker the request's
block table and the prompt tokens the step computes), grows layer by layer as
the forward pass writes KV (`layer_done` after each attention layer,
`step_done` after the step), and ends when D releases it, when its lease
expires after the prefill finished, or when P aborted the request. A D may release it
before P's first step (it refused the request at once): it then starts released.

    running --finish()--> finished --release / expiry / abort--> ended
    (the running request   (vLLM keeps the blocks        (reported once by
     owns the blocks)       for us, delay-free)           take_finished: free them)

A pooled source (issue 29's pool, `offer_pooled`) is a run of a prompt's first blocks in this
instance's host tier, read by a peer that computes the rest itself: ready and finished from the
start, under the lease; its blocks are the tier's (`TierRead`), not P's cache, and no vLLM request
waits on it: it leaves as soon as it ends with no reader (its release, its last reader's unpin, or
a sweep at the next offer or take_finished), closed (the tier's blocks unpinned), unreported.

Invariants: a source of P's cache leaves the table only through take_finished(), and never
while a reader has it pinned (freeing blocks mid-copy would send D another
request's KV). Copies of a source's blocks happen under its `copy_lock`, which
a preemption takes before the blocks are reused.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


def ready_blocks(ready_tokens: int, num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a `num_tokens` prompt are readable once `ready_tokens` of it are
    computed: the full ones, and the partial last one once the prompt is done. The virtual clock
    (cluster/sim/virtual/kv.py) paces its arrivals by the same rule."""
    return -(-num_tokens // block_size) if ready_tokens >= num_tokens else ready_tokens // block_size


EARLY_RELEASES = 4096  # releases of transfers P has not seen yet, remembered


class SourceError(KeyError):
    """No readable source for that transfer (never registered, released, expired or aborted)."""


class TierRead(Protocol):
    """What a pooled source reads its blocks from (transfer/host_tier.py `PooledRun`)."""

    def gather(self, layer: str, group: int, indices: Sequence[int]) -> torch.Tensor:
        """Blocks `indices` of the run in `layer` (of `group`), in host memory."""

    def close(self) -> None:
        """The source ended: its blocks may go."""


@dataclass
class Source:
    transfer_id: str
    request_id: str  # P's vLLM request id: what finished_sending must name
    num_tokens: int  # prompt tokens P computes
    block_sizes: tuple[int, ...]  # tokens per block, per KV-cache group
    block_ids: tuple[tuple[int, ...], ...] = ()  # P's block table per group, as of the latest step
    ready_tokens: dict[str, int] = field(default_factory=dict)  # layer -> prompt tokens whose KV it holds
    step_tokens: int = 0  # where the running step brings every layer
    finished: bool = False
    aborted: bool = False
    released: bool = False
    expires_at: float = math.inf  # set when P finishes: the lease
    readers: int = 0
    copy_lock: threading.Lock = field(default_factory=threading.Lock)
    tier: TierRead | None = None  # a pooled source: its blocks are the host tier's (block_ids unused)

    def ready_blocks(self, layer: str, group: int) -> int:
        """How many leading blocks of `group` are complete in `layer`."""
        return ready_blocks(self.ready_tokens.get(layer, 0), self.num_tokens, self.block_sizes[group])


class SourceTable:
    def __init__(self, layer_groups: dict[str, int], block_sizes: tuple[int, ...], clock=time.monotonic):
        self._layers = layer_groups
        self._block_sizes = block_sizes
        self._clock = clock
        self._cond = threading.Condition()
        self._sources: dict[str, Source] = {}  # transfer_id -> source
        self._stepping: list[Source] = []  # sources the running step computes
        # Transfers a D released before P's first step made their source (D refused the request at
        # once; with push, P may not have scheduled it yet): each starts released. Bounded, oldest
        # forgotten first (ids are never reused; only an authenticated D can release).
        self._released_early: dict[str, None] = {}
        self.waiting = 0  # readers waiting for a transfer this P has not seen yet (a D that asked first)

    # ------------------------------------------------------------ the forward pass (P's worker thread)

    def step(self, transfer_id: str, request_id: str, num_tokens: int, block_ids: tuple[tuple[int, ...], ...],
             step_tokens: int) -> None:
        """Before a forward pass: it will compute `transfer_id` up to `step_tokens` in these blocks."""
        with self._cond:
            src = self._sources.get(transfer_id)
            if src is None:
                src = self._sources[transfer_id] = Source(transfer_id, request_id, num_tokens, self._block_sizes)
                if transfer_id in self._released_early:
                    del self._released_early[transfer_id]
                    src.released = True
            assert src.request_id == request_id, (
                f"transfer {transfer_id} produced by {src.request_id} and {request_id}: the router reused an id")
            src.block_ids = block_ids
            src.step_tokens = min(step_tokens, num_tokens)
            self._stepping.append(src)
            self._cond.notify_all()

    def preempted(self, request_id: str) -> None:
        """P's scheduler took the request's blocks back: nothing of it is ready any more."""
        with self._cond:
            for src in self._sources.values():
                if src.request_id == request_id:
                    with src.copy_lock:  # wait out a copy in progress: the blocks are about to be reused
                        src.ready_tokens.clear()
                        src.block_ids = ()

    def layer_done(self, layer: str) -> None:
        if not self._stepping:
            return
        with self._cond:
            for src in self._stepping:
                src.ready_tokens[layer] = max(src.ready_tokens.get(layer, 0), src.step_tokens)
            self._cond.notify_all()

    def step_done(self) -> None:
        """After the forward pass: every layer holds the step's tokens (layers the
        model runs without a save hook included)."""
        with self._cond:
            for src in self._stepping:
                for layer in self._layers:
                    src.ready_tokens[layer] = max(src.ready_tokens.get(layer, 0), src.step_tokens)
            self._stepping.clear()
            self._cond.notify_all()

    def finish(self, transfer_id: str, lease_s: float, aborted: bool = False) -> None:
        """P's request ended (its blocks now wait for take_finished); abort ends the source now."""
        with self._cond:
            src = self._sources.get(transfer_id)
            assert src is not None, f"finish of {transfer_id}, which never ran on this worker"
            src.finished = True
            src.aborted = aborted
            src.expires_at = self._clock() + lease_s
            self._cond.notify_all()

    def offer_pooled(self, transfer_id: str, tier: TierRead, num_tokens: int, lease_s: float) -> None:
        """A run of `num_tokens` prompt tokens' blocks in the host tier, for a peer to read within
        `lease_s` (ValueError if the transfer id is taken)."""
        for ended in self._take_ended_pooled():  # an idle holder's expired ones go here, at the latest
            ended.tier.close()
        with self._cond:
            if transfer_id in self._sources:
                raise ValueError(f"transfer {transfer_id} already has a source on this instance")
            self._sources[transfer_id] = Source(
                transfer_id, "", num_tokens, self._block_sizes, ready_tokens=dict.fromkeys(self._layers, num_tokens),
                finished=True, expires_at=self._clock() + lease_s, tier=tier)
            self._cond.notify_all()

    # ------------------------------------------------------------ readers (the KV server's threads)

    def acquire(self, transfer_id: str, wait_s: float) -> Source:
        """Pin a source for reading. Waits up to `wait_s` for it to appear: D may ask
        before P's scheduler has run the request (push), or before P's worker heard of it."""
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                src = self._sources.get(transfer_id)
                now = self._clock()
                if src is not None:
                    if self._ended(src, now):
                        raise SourceError(f"transfer {transfer_id} already {self._why_ended(src)}")
                    src.readers += 1
                    return src
                if now >= deadline:
                    raise SourceError(f"no transfer {transfer_id} on this P (not scheduled within {wait_s:.1f} s)")
                self.waiting += 1
                try:
                    self._cond.wait(deadline - now)
                finally:
                    self.waiting -= 1

    def wait_for_progress(self, src: Source, seen: dict[str, int], timeout_s: float) -> None:
        """Block until some layer of `src` is readier than `seen`, or it aborted, or the timeout."""
        with self._cond:
            self._cond.wait_for(lambda: src.aborted or src.ready_tokens != seen, timeout=timeout_s)

    def unpin(self, src: Source) -> None:
        with self._cond:
            assert src.readers > 0, f"unpin of {src.transfer_id} without acquire"
            src.readers -= 1
            done = self._end_pooled(src)
        if done:
            src.tier.close()

    def release(self, transfer_id: str) -> bool:
        """D is done with it. False if there was no live source (one P has not made yet starts
        released)."""
        with self._cond:
            src = self._sources.get(transfer_id)
            if src is None:
                self._released_early[transfer_id] = None
                if len(self._released_early) > EARLY_RELEASES:
                    del self._released_early[next(iter(self._released_early))]
                return False
            if src.released:
                return False
            src.released = True
            self._cond.notify_all()
            done = self._end_pooled(src)
        if done:
            src.tier.close()
        return True

    def _end_pooled(self, src: Source) -> bool:
        """A pooled source that ended with no reader leaves at once, not at the holder's next step
        (it may be idle); the caller closes it outside the lock. Under the lock."""
        if src.tier is None or src.readers or not self._ended(src, self._clock()):
            return False
        self._sources.pop(src.transfer_id, None)
        return True

    # ------------------------------------------------------------ the scheduler's view

    def _take_ended_pooled(self) -> list[Source]:
        with self._cond:
            return [s for s in list(self._sources.values()) if self._end_pooled(s)]

    def take_finished(self) -> set[str]:
        """P request ids whose source ended with no reader: vLLM may free their blocks now. Pooled
        sources that ended are closed here, and not reported (no request of P's holds them)."""
        now = self._clock()
        with self._cond:
            done = [s for s in self._sources.values() if s.finished and self._ended(s, now) and not s.readers]
            for s in done:
                del self._sources[s.transfer_id]
        for s in done:
            if s.tier is not None:
                s.tier.close()
        return {s.request_id for s in done if s.tier is None}

    def _ended(self, src: Source, now: float) -> bool:
        return src.released or src.aborted or now >= src.expires_at

    @staticmethod
    def _why_ended(src: Source) -> str:
        return "released" if src.released else "aborted on P" if src.aborted else "expired"

    def __len__(self) -> int:
        with self._cond:
            return len(self._sources)


class TransferIdInUse(ValueError):
    """A prefill named a transfer whose source may still exist on this P."""


class TransferIds:
    """The transfer ids P's engine took, from a prefill's start until its source can no longer be
    in the worker's table (the prefill's end plus the lease). The router makes every id unique
    (router/lifecycle.py: Dispatch.new_id); a prefill naming one still in use is refused here, in
    P's engine actor, as an error for that request: in the worker's SourceTable the clash would
    be an assert in the model runner, which ends vLLM's engine core."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        self._lease_s = lease_s
        self._clock = clock
        self._running: set[str] = set()
        self._ended: dict[str, float] = {}  # id -> when its source is gone at the latest (insertion order = that order)

    def take(self, transfer_id: str) -> None:
        now = self._clock()
        while self._ended and (oldest := next(iter(self._ended.items())))[1] <= now:
            del self._ended[oldest[0]]
        if transfer_id in self._running or transfer_id in self._ended:
            raise TransferIdInUse(f"transfer id {transfer_id!r} is in use on this P (the router names each "
                                  "transfer once): request refused")
        self._running.add(transfer_id)

    def end(self, transfer_id: str) -> None:
        """The prefill ended (done, failed or cancelled): its source goes within a lease."""
        if transfer_id in self._running:
            self._running.discard(transfer_id)
            self._ended[transfer_id] = self._clock() + self._lease_s

    @contextlib.contextmanager
    def taken(self, transfer_id: str):
        """`transfer_id` taken for the block (raises TransferIdInUse), ended after it."""
        self.take(transfer_id)
        try:
            yield
        finally:
            self.end(transfer_id)

    def __len__(self) -> int:
        return len(self._running) + len(self._ended)
