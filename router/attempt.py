"""One attempt at a request (router/lifecycle.py): one route, one P (or none), one D, and what
it holds in the picker's counts while its parts run.

A request has one attempt at a time; a move off a lost instance (router/migration.py) ends the
attempt and begins another on a new route.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Generic

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeDelta, PrefillResult, SamplingSpec
from pdcluster.router.backend import BackendError
from pdcluster.router.openai_models import PdUsage
from pdcluster.router.routing import I, InstancePicker, Route


@dataclass
class Attempt(Generic[I]):
    number: int
    route: Route[I]
    first: bool  # no token sent yet: this attempt's events are the record's
    prompt: list[int]
    sampling: SamplingSpec
    engine_rid: str
    push: bool
    handle: TransferHandle | None = None  # where D finds P's KV (None: D prefills, or another connector's)
    pre: PrefillResult | None = None
    p_waiting: bool = False  # P was asked and has not answered (or failed)
    pool_waiting: bool = False  # the pool's holder was asked to offer the prefix and has not answered
    d_running: bool = False  # D was asked and has not finished
    got_token: bool = False
    held: DecodeDelta | None = None  # D's failed finish, while P's fate is checked
    deferred: DecodeDelta | None = None  # push: D's last delta, waiting for P's answer
    so_far: PdUsage | None = None  # the P/D report the chunks before the last carry
    # Invariant: each stack holds its picker count exactly while that part runs (routing.py).
    p_slot: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # P's load, pick to answer
    local_slot: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # D's local slot, to 1st token
    decoding: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # D's load

    @property
    def pooled(self) -> bool:
        """D prefills the request itself, reading first what a P's tier offered (the pool)."""
        return self.route.local_prefill and self.handle is not None

    def close_p_slot_failed(self) -> None:
        """Out of P's load, P never having answered: its promise of blocks is not kept (the
        picker's `prefilling` marks P done only on a clean exit)."""
        self.p_slot.__exit__(BackendError, BackendError("P did not answer"), None)

    def release(self, picker: InstancePicker[I]) -> None:
        """Free everything the attempt holds in the picker. Idempotent."""
        self.local_slot.close()
        self.decoding.close()
        self.close_p_slot_failed()
        picker.ended(self.route)
