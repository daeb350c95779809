"""The pool's steps of one request's lifecycle (router/lifecycle.py): the instance that prefills
the request (D for a local prefill, else P) reading the first blocks of its prompt from a P's host
tier (issue 29; docs/kv_tiers.md "The pool").

The route names the holder (`Route.pool`, router/routing.py); the lifecycle sends it `OpenPool`
and waits for its offer (`waiting_for_pool`); then:

    pool_opened  -> D reads: Decode(a handle for what the holder offered; none if it offered nothing)
                    P reads: (push: Decode(P's handle)), Prefill(the offer's handle, or none)
    pool_failed  -> the same without the offer: the reader computes the prefix, the record's
                    pool_error says why
    D's read fails before a token -> Abort, Routed (a new attempt that reads no tier), ...
    (P's read failing is P's own business: it computes those tokens, PrefillResult.p_pool says so.)

`PoolSteps` is `Lifecycle`'s half for them; it reads the lifecycle's `attempt`, `rec`, `sent`,
`dispatch` and `done`, sets `pool_ok`, and calls its `_current`, `_send_decode`, `_send_prefill`,
`_end_attempt` and `_begin_attempt`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Generic, TypeVar

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeDelta, PoolOffer
from pdcluster.router.lifecycle_commands import Command, Failure
from pdcluster.router.recording import forget_attempt

if TYPE_CHECKING:
    from pdcluster.router.attempt import Attempt

log = logging.getLogger(__name__)

I = TypeVar("I")  # noqa: E741  (the instance type)


class PoolSteps(Generic[I]):
    """The lifecycle's pool half; see the module docstring."""

    pool_ok: bool  # False once D's read of a P's tier failed: the request's later attempts read none

    @property
    def waiting_for_pool(self) -> bool:
        """The pool's holder's offer is awaited (nothing else is, meanwhile)."""
        return not self.done and self.attempt is not None and self.attempt.pool_waiting

    def pool_opened(self, attempt: int, offer: PoolOffer, now_ns: int) -> list[Command]:
        """The holder offers `offer.num_tokens` of the prompt: the reader reads them and computes
        the rest (none: its tier lost them since its events, the reader computes it all)."""
        a = self._current(attempt)
        a.pool_waiting = False
        holder, handle = a.route.pool, None
        if offer.num_tokens:
            handle = TransferHandle(holder.engine_id, holder.kv_address, offer.transfer_id, offer.num_tokens,
                                    self.dispatch.transport)
        if not a.route.local_prefill:
            return self._send_prefill(a, handle)
        a.handle = handle
        return self._send_decode(a, a.handle)

    def pool_failed(self, attempt: int, failure: Failure, now_ns: int) -> list[Command]:
        """The holder did not offer (lost, or it raised): the reader computes the prefix, as with
        no pool."""
        a = self._current(attempt)
        a.pool_waiting = False
        self.rec.pool_error = f"{a.route.pool.name} did not offer the prefix ({failure.kind}): {failure.message}"
        local = a.route.local_prefill
        log.warning("%s: %s; %s computes it", self.rec.request_id, self.rec.pool_error, "D" if local else "P")
        return self._send_decode(a, None) if local else self._send_prefill(a, None)

    def _pool_read_failed(self, a: Attempt[I], delta: DecodeDelta, now_ns: int) -> list[Command]:
        """D's read of a P's tier failed before a token (the holder died, its lease ran out): again
        on a new attempt that reads no tier, D computing the prefix."""
        a.d_running, self.pool_ok = False, False
        why = delta.transfer.error if delta.transfer and delta.transfer.error else delta.finish_reason
        self.rec.pool_error = f"D's read from {a.route.pool.name}'s tier failed: {why}"
        log.warning("%s: %s; D computes the prompt", self.rec.request_id, self.rec.pool_error)
        out = self._end_attempt()
        if not self.sent:
            forget_attempt(self.rec)
        return out + self._begin_attempt(now_ns)
