"""One request's P/D lifecycle, written once and without I/O.

A `Lifecycle` is the sequence of one request through the cluster as a state machine, in the
manner of h11: its driver tells it what happened (an input method, with the time) and does
what it answers (a list of commands). It owns no socket, clock or task, so one sequence serves
every driver:

- router/pd_dispatch.py drives it with asyncio over the engines' request channels (real vLLM,
  or the real-time simulated engines);
- cluster/sim/virtual/router.py drives it on the virtual clock.

The sequence (docs/architecture.md walks it with the functions that do it):

    start          -> Routed, then per route:
                        local prefill: Decode(no handle)                 D alone
                        ... with pool: OpenPool                          a P's tier offers the prefix
                        push:          Decode(the handle), Prefill       D asks P while P computes
                        pull:          Prefill                           D after P's answer
                        ... with pool: OpenPool                          a peer P's tier offers it to P
    pool_opened    -> D's read: Decode(the pool's handle, or none if it offered nothing);
                      P's read: (push) Decode(the handle), Prefill(the pool's handle, or none)
                      pool_failed: the same without the pool's handle (router/lifecycle_pool.py)
    prefill_answered -> (pull) Decode(the handle); (push) nothing, or D's deferred last chunk
    decode_output    -> Emit(chunk) ...; the last: Emit, Abort, Finished;
                        D's pool read failed before a token: Abort, Routed (no pool), ...
    *_failed         -> a lost instance: Abort, Routed, ... (the request moves, router/migration.py);
                        else Abort, Finished(error)
    cancel           -> Abort (the client left, the router stops)
    close            -> the record, finished

Inputs after the request is over, or of an attempt already abandoned, are the driver's bug.
The record (router/timeline.py) is filled here, from the engines' own reports
(router/recording.py); the picker (router/routing.py) counts each instance's load from the
pick to the end of each part, and learns P's prefill times.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Generic

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TokenLogprobs,
)
from pdcluster.router.attempt import Attempt
from pdcluster.router.backend import BackendError, GenerationChunk
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle_commands import (
    Abort,
    CheckLost,
    Command,
    Decode,
    Emit,
    Failure,
    Finished,
    OpenPool,
    Prefill,
    Routed,
    pd_final,
    pd_so_far,
)
from pdcluster.router.lifecycle_pool import PoolSteps
from pdcluster.router.migration import InstanceLost, continuation
from pdcluster.router.openai_models import PdUsage
from pdcluster.router.prefix_index import RouterHash
from pdcluster.router.recording import forget_attempt, record_decode_end, record_prefill, record_route, record_tokens
from pdcluster.router.routing import I, NoInstanceUp
from pdcluster.router.timeline import Migration, RequestRecord

log = logging.getLogger(__name__)

class Lifecycle(PoolSteps[I], Generic[I]):
    """One request, from its admission (the driver asked `Dispatch.admit`) to `close`."""

    def __init__(self, dispatch: Dispatch[I], request_id: str, prompt: list[int], sampling: SamplingSpec,
                 arrival_ns: int, hashes: Sequence[RouterHash] | None = None):
        """`hashes`: the prompt's router hashes, if the driver has them (the virtual clock)."""
        self.dispatch = dispatch
        self.prompt, self.sampling, self._hashes = prompt, sampling, hashes
        self.rec = RequestRecord(request_id, prompt_tokens=len(prompt))
        self.rec.mark("arrival", arrival_ns)
        self.sent: list[int] = []  # output tokens the client has
        self.avoid: set[str] = set()  # instances lost under this request
        # False once D's read of a P's tier failed: the rest read none. Prompt logprobs need every
        # prompt token computed: no pool then.
        self.pool_ok = sampling.prompt_logprobs is None
        # The prompt's logprobs, from whoever prefilled it first (a P, or D alone), when asked.
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
        self.attempt: Attempt[I] | None = None
        self.done = False  # Finished was emitted
        self._closed = False
        self._attempts = itertools.count()
        dispatch.in_flight += 1

    # -- what the driver asks

    @property
    def waiting_for_prefill(self) -> bool:
        """P's answer is awaited (feed it when it comes, even while D streams)."""
        return not self.done and self.attempt is not None and self.attempt.p_waiting

    @property
    def waiting_for_decode(self) -> bool:
        a = self.attempt
        return not self.done and a is not None and a.d_running and a.held is None and a.deferred is None

    # -- inputs

    def start(self, now_ns: int) -> list[Command]:
        return self._begin_attempt(now_ns)

    def prefill_answered(self, attempt: int, result: PrefillResult, now_ns: int) -> list[Command]:
        a = self._current(attempt)
        a.p_waiting, a.pre = False, result
        self._got_prompt_logprobs(result.prompt_logprobs)
        a.p_slot.close()  # out of P's load; its promise of blocks now waits only for the events
        engine = result.engine
        if engine.scheduled_ns and engine.first_token_ns > engine.scheduled_ns:  # both on P's clock
            self.dispatch.picker.prefilled(result.p_cached_tokens, len(a.prompt),
                                           (engine.first_token_ns - engine.scheduled_ns) / 1e9, result.p_tier_tokens,
                                           result.p_pool_tokens)
        if a.first:
            record_prefill(self.rec, result, self.dispatch.clock_of(a.route.prefill.name))
        if a.deferred is not None:  # push: D had finished first
            return self._deliver(a, a.deferred, now_ns)
        if a.push:
            return []
        return self._send_decode(a, a.handle, result.connector_params)

    def prefill_failed(self, attempt: int, failure: Failure, now_ns: int) -> list[Command]:
        a = self._current(attempt)
        a.p_waiting = False
        a.close_p_slot_failed()
        p = a.route.prefill.name
        if a.push and (a.got_token or a.deferred is not None):  # D had every layer's KV: P no longer matters
            log.warning("P failed after D had every layer's KV (the request finished): %s", failure.message)
            return self._deliver(a, a.deferred, now_ns) if a.deferred is not None else []
        if failure.kind == "lost":
            return self._lost(InstanceLost("prefill", p, failure.message), now_ns)
        if failure.kind == "timeout":
            return self._fail(BackendError(f"prefill of {self.rec.request_id} on {p} timed out after "
                                           f"{self.dispatch.request_timeout_s:.0f} s", 504, "timeout"))
        return self._fail(BackendError(f"prefill on {p} failed: {failure.message}", 500))

    def decode_output(self, attempt: int, delta: DecodeDelta | None, now_ns: int) -> list[Command]:
        """D's next output (the driver may merge deltas that arrived together); None: D's stream
        ended without a finish."""
        a = self._current(attempt)
        d = a.route.decode.name
        if delta is None:
            a.d_running = False
            return self._fail(BackendError(f"decode instance {d} ended {self.rec.request_id} without a finish", 502))
        if delta.finish_reason in ("error", "abort") and not a.got_token and not a.route.local_prefill:
            a.held = delta  # D's KV load failed: because P went away, or on its own?
            return [CheckLost(a.number, a.route.prefill)]
        if delta.finish_reason in ("error", "abort") and not a.got_token and a.pooled:
            return self._pool_read_failed(a, delta, now_ns)
        return self._take(a, delta, now_ns)

    def p_lost(self, attempt: int, lost: bool, now_ns: int) -> list[Command]:
        a = self._current(attempt)
        delta, a.held = a.held, None
        if lost:
            return self._lost(InstanceLost("prefill", a.route.prefill.name, "it was lost while D loaded its KV"), now_ns)
        return self._take(a, delta, now_ns)

    def decode_failed(self, attempt: int, failure: Failure, now_ns: int) -> list[Command]:
        a = self._current(attempt)
        a.d_running = False
        d = a.route.decode.name
        if failure.kind == "lost" or failure.message.startswith("EngineDeadError"):  # its vLLM core died
            return self._lost(InstanceLost("decode", d, failure.message), now_ns)
        if failure.kind == "timeout":
            return self._fail(BackendError(f"decode on {d} timed out after {self.dispatch.request_timeout_s:.0f} s",
                                           504, "timeout"))
        if failure.message.startswith("VLLMValidationError"):  # D's vLLM refused what only it can judge
            return self._fail(BackendError(failure.message.partition(": ")[2], 400, "invalid_request_error"))
        return self._fail(BackendError(f"decode on {d} failed: {failure.message}", 500))

    def timed_out(self, now_ns: int) -> list[Command]:
        """The request's deadline passed while the driver waited for P or D."""
        a = self.attempt
        if a.pool_waiting:
            a.pool_waiting = False
            return self._fail(BackendError(f"{a.route.pool.name}'s offer of {self.rec.request_id}'s prefix did not "
                                           f"come within {self.dispatch.request_timeout_s:.0f} s", 504, "timeout"))
        if a.p_waiting and (a.deferred is not None or not (a.push and a.got_token)):
            return self.prefill_failed(a.number, Failure("timeout"), now_ns)
        return self.decode_failed(a.number, Failure("timeout"), now_ns)

    def cancel(self, stopping: bool) -> list[Command]:
        """The client went away or stopped reading, or the router is stopping."""
        if self.done:
            return []
        self.rec.error = ("cancelled: the router stopped" if stopping
                          else "cancelled: the client went away or stopped reading")
        self.done = True
        return self._end_attempt()

    def close(self, now_ns: int) -> RequestRecord:
        """The driver is done with the request: its record, finished. Idempotent."""
        if not self._closed:
            self._closed = True
            if not self.done:  # the driver stopped without an answer or a cancel
                self.done = True
                self._end_attempt()
            self.dispatch.in_flight -= 1
            self.rec.mark("finish", now_ns)
        return self.rec

    # -- the sequence

    def _current(self, attempt: int) -> Attempt[I]:
        a = self.attempt
        assert not self.done and a is not None and a.number == attempt, (
            f"{self.rec.request_id}: an input for attempt {attempt}, which is not running")
        return a

    def _begin_attempt(self, now_ns: int) -> list[Command]:
        rec, sent, first = self.rec, self.sent, not self.sent
        if len(sent) >= self.sampling.max_tokens:  # lost after its last token came: nothing left to do
            return self._finish([Emit(GenerationChunk([], "length", PdUsage(
                p_cached_tokens=0, d_cached_tokens=0, transferred_tokens=0, migrations=len(rec.migrations))))])
        prompt, sampling = continuation(self.prompt, self.sampling, sent) if sent else (self.prompt, self.sampling)
        picker = self.dispatch.picker
        try:
            route = picker.pick(prompt, sampling.max_tokens, frozenset(self.avoid),
                                hashes=self._hashes if first else None, pool=self.pool_ok)
        except NoInstanceUp as err:
            return self._fail(BackendError(str(err), 503, "service_unavailable"))
        p, d = route.prefill, route.decode
        if rec.migrations:
            rec.migrations[-1].to = p.name if rec.migrations[-1].role == "prefill" and not route.local_prefill else d.name
        if first:
            record_route(rec, route, picker.policy)
            rec.mark("dispatch", now_ns)
        else:
            rec.decode_instance = d.name
        # Each attempt is a new request to the engines: an aborted earlier one may still be
        # leaving P's engine, and two requests of one id there would take each other's blocks.
        engine_rid = self.dispatch.new_id(rec.request_id)
        a = self.attempt = Attempt(next(self._attempts), route, first, prompt, sampling, engine_rid,
                                    push=self.dispatch.transfer_mode == "push")
        out: list[Command] = [Routed(a.number, route)]
        if route.local_prefill:  # D alone: no P, no transfer, D prefills what its cache lacks
            a.local_slot.enter_context(picker.prefilling_locally(route))
            if route.pool is not None and self.pool_ok:  # ... past what a P's tier offers it
                a.pool_waiting = True
                return out + [OpenPool(a.number, route.pool, PoolRequest(engine_rid, prompt))]
            return out + self._send_decode(a, None)
        # P's load counts from the pick: a request right behind this one must see it.
        a.p_slot.enter_context(picker.prefilling(route, len(prompt)))
        # The transfer's handle, named here once: where P's KV will be, under the transfer's name
        # (the engine request's id), over the transport the router chose. A P without a KV server
        # (another connector's, such as vLLM's NIXL) names its own in its answer (`connector_params`).
        if getattr(p, "kv_address", None):
            a.handle = TransferHandle(p.engine_id, p.kv_address, engine_rid, len(prompt), self.dispatch.transport)
        if route.pool is not None and self.pool_ok:  # P reads the prompt's first blocks from a peer's tier: its offer first
            a.pool_waiting = True
            return out + [OpenPool(a.number, route.pool, PoolRequest(engine_rid, prompt))]
        return out + self._send_prefill(a, None)

    def _send_prefill(self, a: Attempt[I], pool: TransferHandle | None) -> list[Command]:
        """P's prefill (`pool`: the peer's offer P reads first), and D's request with it in push mode."""
        out: list[Command] = []
        if a.push:
            # D first: D allocates its blocks and asks P for them while P computes them. D's
            # tokens need not wait for P's answer: once D has every layer's KV, P's last layer's
            # MLP, sampling and reply are no business of D's.
            out += self._send_decode(a, a.handle)
        a.p_waiting = True
        return out + [Prefill(a.number, a.route.prefill,
                              PrefillRequest(a.engine_rid, a.prompt, a.sampling, transfer_id=a.engine_rid, pool=pool))]

    def _send_decode(self, a: Attempt[I], handle: TransferHandle | None,
                     connector_params: dict | None = None) -> list[Command]:
        a.d_running = True
        a.decoding.enter_context(self.dispatch.picker.decoding(a.route, len(a.prompt), a.sampling.max_tokens,
                                                                a.sampling.n))
        sampling = a.sampling  # the prompt's logprobs are the prefiller's to compute: D's only alone
        if not a.route.local_prefill and sampling.prompt_logprobs is not None:
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        return [Decode(a.number, a.route.decode,
                       DecodeRequest(a.engine_rid, a.prompt, sampling, handle, connector_params))]

    def _take(self, a: Attempt[I], delta: DecodeDelta, now_ns: int) -> list[Command]:
        """D's output, recorded; the last one waits for P's answer in push mode (for the record)."""
        rec = self.rec
        record_tokens(rec, delta, self.dispatch.clock_of(a.route.decode.name), now_ns)
        self._got_prompt_logprobs(delta.prompt_logprobs)
        if delta.new_token_ids:
            a.got_token = True
            a.local_slot.close()
        if delta.finish_reason is None:
            return self._deliver(a, delta, now_ns)
        a.d_running = False
        if a.first:
            record_decode_end(rec, delta, self.dispatch.clock_of(a.route.decode.name),
                              pooled=a.pooled)
        rec.finish_reason = delta.finish_reason
        if a.first and a.p_waiting:  # push: P's answer, for its hit and its timeline
            a.deferred = delta
            return []
        return self._deliver(a, delta, now_ns)

    def _deliver(self, a: Attempt[I], delta: DecodeDelta, now_ns: int) -> list[Command]:
        a.deferred = None
        route = a.route
        if delta.finish_reason in ("error", "abort"):
            if route.local_prefill:
                return self._fail(BackendError(f"decode on {route.decode.name} ended with {delta.finish_reason!r}: "
                                               f"D's own prefill of the request failed or D aborted it", 502))
            why = f" ({delta.transfer.error})" if delta.transfer and delta.transfer.error else ""
            return self._fail(BackendError(f"decode on {route.decode.name} ended with {delta.finish_reason!r}: the KV "
                                           f"transfer from {route.prefill.name} failed or D aborted the request{why}", 502, "kv_transfer_error"))
        p_cached, moves = a.pre.p_cached_tokens if a.pre else 0, len(self.rec.migrations)
        if delta.finish_reason is not None:
            pd = pd_final(route, p_cached, delta, moves, a.pre.p_pool_tokens if a.pre else 0)
        else:  # one report per attempt and P answer, shared by its chunks: no cost per token
            if a.so_far is None or a.so_far.p_cached_tokens != p_cached:
                a.so_far = pd_so_far(route, p_cached, moves)
            pd = a.so_far
        chunk = GenerationChunk(delta.new_token_ids, delta.finish_reason, pd, delta.logprobs,
                                stop_reason=delta.stop_reason, index=delta.index, choice_finish=delta.choice_finish)
        self.sent += chunk.new_token_ids
        if delta.finish_reason is None:
            return [Emit(chunk)]
        if self.sampling.prompt_logprobs is not None:
            if not self.prompt_logprobs:  # push: P failed after D had its KV, taking them along
                return self._fail(BackendError(f"the prompt's logprobs were lost with {route.prefill.name}'s answer", 502))
            chunk = dataclasses.replace(chunk, prompt_logprobs=self.prompt_logprobs)
        return self._finish([Emit(chunk)])

    def _got_prompt_logprobs(self, positions: tuple[TokenLogprobs | None, ...]) -> None:
        """The first prefiller's; a later attempt's prompt is longer by the tokens already sent."""
        if positions and not self.prompt_logprobs:
            self.prompt_logprobs = positions[:len(self.prompt)]

    def _lost(self, lost: InstanceLost, now_ns: int) -> list[Command]:
        """Move the request off a lost instance (router/migration.py), or end it naming why not."""
        out = self._end_attempt()
        rec = self.rec
        if len(rec.migrations) >= self.dispatch.migration_limit:
            moved = f" (off {', '.join(m.lost for m in rec.migrations)})" if rec.migrations else ""
            return out + self._fail(BackendError(f"{lost}; the request was already moved {len(rec.migrations)} times"
                                                 f"{moved}: router.migration_limit", 503, "service_unavailable"))
        if self.sent and self.sampling.n > 1:  # a move goes on from one sequence, and n have begun
            return out + self._fail(BackendError(f"{lost}; a request of n={self.sampling.n} choices that has begun "
                                                 f"is not moved to another instance", 502))
        self.avoid.add(lost.instance)
        picker = self.dispatch.picker
        d_alone = lost.role == "prefill" and picker.local is not None  # D prefills it (router/local_prefill.py)
        if not picker.any_up(lost.role, self.avoid) and not d_alone:
            return out + self._fail(BackendError(f"{lost}; no other {lost.role} instance is up to take the request on",
                                                 503, "service_unavailable"))
        log.warning("%s: %s; moving it on with %d tokens sent", rec.request_id, lost, len(self.sent))
        rec.migrations.append(Migration(now_ns, lost.role, lost.instance, len(self.sent), str(lost)))
        if not self.sent:  # the record tells the attempt that produces the first token
            forget_attempt(rec)
        return out + self._begin_attempt(now_ns)

    def _fail(self, err: BackendError) -> list[Command]:
        out = self._end_attempt()
        self.rec.error = str(err)
        return self._finish(out, err)

    def _finish(self, out: list[Command], err: BackendError | None = None) -> list[Command]:
        out = out + self._end_attempt()
        self.done = True
        return out + [Finished(err)]

    def _end_attempt(self) -> list[Command]:
        """Free what the attempt holds in the picker; abort its calls still running. Idempotent."""
        a, self.attempt = self.attempt, None
        if a is None:
            return []
        a.release(self.dispatch.picker)
        return [Abort(a.number)]

