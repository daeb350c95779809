"""The P/D request path: prefill on a P engine, then decode on a D engine.

`PDDispatcher` implements `TokenBackend` over each engine actor's request channel
(cluster/request_channel.py; Ray only places and watches the actors). It picks P
and D by the configured policy (router/routing.py), bounds every wait by the
request deadline, and turns each failure into a `BackendError` with a status and a
message naming the instance: a dead engine is 503, a timeout 504, a failed KV
transfer 502, an engine's own error 500. Nothing waits forever: on any exit path
the decode call is aborted, which aborts it in vLLM.

Each request leaves a RequestRecord (router/timeline.py), handed to the record
sinks when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import ray

from pdcluster.cluster.messages import (
    DecodeDelta,
    DecodeRequest,
    InstanceInfo,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
)
from pdcluster.cluster.request_channel import EngineCallFailed, EngineChannel, EngineUnavailable, PendingCall
from pdcluster.router.admission import AdmissionLimits, admit
from pdcluster.router.backend import BackendError, GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.local_prefill import LocalPrefillSpec
from pdcluster.router.migration import DEFAULT_MIGRATION_LIMIT, InstanceLost, continuation
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.policies import Policy
from pdcluster.router.prefill_cost import PrefillCost
from pdcluster.router.recording import (
    RecordSink,
    forget_attempt,
    record_decode_end,
    record_prefill,
    record_route,
    record_tokens,
)
from pdcluster.router.routing import InstancePicker, NoInstanceUp, PrefixLookup, Route
from pdcluster.router.timeline import ClockOffset, Migration, RequestRecord
from pdcluster.transfer.handle import TransferHandle

log = logging.getLogger(__name__)

# How long a failed KV load waits to learn whether its P was lost (then the request moves to
# another P) or the transfer alone failed (a 502): the channel's FIN comes with P's death.
LOST_GRACE_S = 1.0


@dataclass(frozen=True)
class Instance:
    name: str  # "prefill-0"
    actor: ray.actor.ActorHandle
    engine_id: str = ""
    kv_address: str | None = None  # P: its KV server, where D asks for blocks


class PDDispatcher(TokenBackend):
    def __init__(self, prefill: list[Instance], decode: list[Instance], card: ModelCard, request_timeout_s: float,
                 sinks: list[RecordSink] | None = None, transfer_mode: str = "pull", transport: str = "grpc",
                 policy: Policy = "round_robin", block_size: int = 128, lookup: PrefixLookup | None = None,
                 channels: dict[str, EngineChannel] | None = None, pending: PendingBlocks | None = None,
                 cost: PrefillCost | None = None, local: LocalPrefillSpec | None = None,
                 admission: AdmissionLimits | None = None, migration_limit: int = DEFAULT_MIGRATION_LIMIT):
        assert prefill and decode, "a P/D cluster needs at least one P and one D instance"
        assert transfer_mode == "pull" or all(p.kv_address for p in prefill), (
            "push mode needs every P's KV address (InstanceInfo.kv_address)")
        self.transfer_mode = transfer_mode
        self.transport = transport  # grpc | torch_dist, per transfer (the handle names it)
        self._transfer_seq = itertools.count()
        self.prefill, self.decode = prefill, decode
        self._card = card
        self._timeout_s = request_timeout_s
        # Only instances whose channel is up get new requests: a dead host's are skipped from
        # the moment its connection ends (its FIN, keepalive, or Ray's word) until it is back.
        self.picker = InstancePicker(policy, prefill, decode, block_size, lookup, is_up=self._channel_up,
                                     pending=pending, cost=cost, local=local)
        self.sinks: list[RecordSink] = list(sinks or [])
        self.begin_sinks: list[RecordSink] = []  # hear each record as its request comes in (the run's journal)
        self.stopping = False  # the router is stopping: requests still running are ended by it
        # router/admission.py (None: every request is taken in); each refusal's reason goes to
        # the listeners (the metrics).
        self.admission = admission
        self.accepted_in_flight = 0  # requests taken in and not finished
        self.migration_limit = migration_limit  # moves per request off lost instances (router/migration.py)
        self.rejection_listeners: list[Callable[[str], None]] = []
        # Instance clock - router clock; instances not measured count as on this clock.
        self.clocks: dict[str, ClockOffset] = {}
        # Instance name -> its request channel (connect_channels; tests pass fakes).
        self.channels: dict[str, EngineChannel] = dict(channels or {})
        # Instance name -> its InstanceInfo as of its channel's last (re)connection.
        self.infos: dict[str, InstanceInfo] = {}
        self.instance_listeners: list[Callable[[InstanceInfo], None]] = []  # hear every refreshed InstanceInfo

    def _channel_up(self, name: str) -> bool:
        channel = self.channels.get(name)
        return channel is None or getattr(channel, "connected", True)  # tests' fake channels are always up

    async def connect_channels(self, secret: str) -> None:
        """Open every instance's request channel (at the address each engine advertises;
        both ends prove the cluster secret). On every reconnection, before the instance is
        back in rotation, what the router knows of it is refreshed (`refresh_instance`)."""
        insts = self.prefill + self.decode
        channels = await asyncio.gather(*(
            EngineChannel(i.name, i.actor, secret, before_up=lambda name=i.name: self.refresh_instance(name)).connect()
            for i in insts))
        self.channels = {i.name: c for i, c in zip(insts, channels)}

    async def refresh_instance(self, name: str) -> None:
        """Ask the instance for its InstanceInfo. Ray restarts a dead instance on any node its
        placement allows: on another one, P's KV address (which push mode hands D) and the
        instance's clock change, and the listeners (the KV-event feed) hear of it."""
        role_list = self.prefill if any(i.name == name for i in self.prefill) else self.decode
        k, inst = next((k, i) for k, i in enumerate(role_list) if i.name == name)
        info = await inst.actor.info.remote()
        before, self.infos[name] = self.infos.get(name), info
        moved = dataclasses.replace(inst, engine_id=info.engine_id, kv_address=info.kv_address)
        if moved != inst:
            role_list[k] = moved
            self.picker.replace(moved)
        if before is not None and before.node_ip != info.node_ip:
            log.warning("%s restarted on node %s (was %s): new addresses %s", name, info.node_ip, before.node_ip,
                        info.planes)
            self.clocks[name] = await self._measure_clock(moved, same_host=info.node_ip == ray.util.get_node_ip_address())
        for listener in self.instance_listeners:
            listener(info)

    def close_channels(self) -> None:
        for channel in self.channels.values():
            channel.close()

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests on each instance now (P: prefilling; D: receiving its KV or decoding)."""
        return self.picker.in_flight()

    async def measure_clocks(self, same_host: set[str] = frozenset()) -> dict[str, ClockOffset]:
        """Offset and uncertainty per instance: exactly 0 for instances on this host
        (CLOCK_MONOTONIC is one clock per host), else the best of 3 round trips."""
        for inst in self.prefill + self.decode:
            self.clocks[inst.name] = await self._measure_clock(inst, inst.name in same_host)
        return dict(self.clocks)

    @staticmethod
    async def _measure_clock(inst: Instance, same_host: bool) -> ClockOffset:
        if same_host:
            return ClockOffset(0, 0)
        best = None
        for _ in range(3):
            before = time.monotonic_ns()
            instance_ns = await inst.actor.clock.remote()
            offset = ClockOffset.measure(before, instance_ns, time.monotonic_ns())
            best = offset if best is None or offset.uncertainty_ns < best.uncertainty_ns else best
        return best

    def _clock(self, inst: Instance) -> ClockOffset:
        return self.clocks.get(inst.name, ClockOffset(0, 0))

    def model_card(self) -> ModelCard:
        return self._card

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                       arrival_ns: int | None = None) -> AsyncIterator[GenerationChunk]:
        # Before anything is recorded or routed: a refused request costs nothing more.
        if self.admission is not None:
            rejection = admit(self.admission, self.accepted_in_flight, self.picker.least_queued_s())
            if rejection is not None:
                for listener in self.rejection_listeners:
                    listener(rejection.reason)
                raise BackendError(rejection.message, 429, "rate_limit_exceeded", rejection.retry_after_s)
        self.accepted_in_flight += 1
        try:
            # Each layer closes the one below as it is closed itself (aclosing): a generator left
            # to the garbage collector runs its `finally` (the record, D's abort) only later, after
            # the router's stop may have closed the run's file.
            async with contextlib.aclosing(self._recorded(request_id, prompt_token_ids, sampling, arrival_ns)) as it:
                async for chunk in it:
                    yield chunk
        finally:
            self.accepted_in_flight -= 1

    async def _recorded(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                        arrival_ns: int | None) -> AsyncIterator[GenerationChunk]:
        rec = RequestRecord(request_id, prompt_tokens=len(prompt_token_ids))
        rec.mark("arrival", arrival_ns)
        for sink in self.begin_sinks:
            sink(rec)
        try:
            async with contextlib.aclosing(self._generate(rec, prompt_token_ids, sampling)) as it:
                async for chunk in it:
                    yield chunk
        except BackendError as err:
            rec.error = str(err)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            rec.error = ("cancelled: the router stopped" if self.stopping
                         else "cancelled: the client went away or stopped reading")
            raise
        finally:
            rec.mark("finish")
            for sink in self.sinks:
                sink(rec)

    async def _generate(self, rec: RequestRecord, prompt: list[int], sampling: SamplingSpec
                        ) -> AsyncIterator[GenerationChunk]:
        """Attempts until one finishes: a lost instance moves the request on (router/migration.py)."""
        deadline = time.monotonic() + self._timeout_s
        sent: list[int] = []  # output tokens the consumer has
        avoid: set[str] = set()  # instances lost under this request
        while True:
            if len(sent) >= sampling.max_tokens:  # lost after its last token came: nothing left to do
                yield GenerationChunk([], finish_reason="length", migrations=len(rec.migrations))
                return
            attempt_prompt, attempt_sampling = continuation(prompt, sampling, sent) if sent else (prompt, sampling)
            try:
                async with contextlib.aclosing(self._attempt(rec, attempt_prompt, attempt_sampling, deadline,
                                                             first=not sent, avoid=frozenset(avoid))) as it:
                    async for chunk in it:
                        sent += chunk.new_token_ids
                        yield dataclasses.replace(chunk, migrations=len(rec.migrations)) if rec.migrations else chunk
                return
            except InstanceLost as lost:
                if len(rec.migrations) >= self.migration_limit:
                    moved = f" (off {', '.join(m.lost for m in rec.migrations)})" if rec.migrations else ""
                    raise BackendError(f"{lost}; the request was already moved {len(rec.migrations)} times{moved}: "
                                       f"router.migration_limit", 503, "service_unavailable") from None
                avoid.add(lost.instance)
                if not self.picker.any_up(lost.role, avoid):
                    raise BackendError(f"{lost}; no other {lost.role} instance is up to take the request on", 503,
                                       "service_unavailable") from None
                log.warning("%s: %s; moving it on with %d tokens sent", rec.request_id, lost, len(sent))
                rec.migrations.append(Migration(time.monotonic_ns(), lost.role, lost.instance, len(sent), str(lost)))
                if not sent:  # the record tells the attempt that produces the first token
                    forget_attempt(rec)

    async def _attempt(self, rec: RequestRecord, prompt_token_ids: list[int], sampling: SamplingSpec,
                       deadline: float, first: bool, avoid: frozenset[str]) -> AsyncIterator[GenerationChunk]:
        """One route, one P (or none), one D. `first`: no token sent yet, so this attempt's events
        are the record's; after a migration past the first token only its tokens are."""
        try:
            route = self.picker.pick(prompt_token_ids, sampling.max_tokens, avoid)
        except NoInstanceUp as err:
            raise BackendError(str(err), 503, "service_unavailable") from None
        p, d = route.prefill, route.decode
        p_connection = self._connection(p)  # P's channel now: another one later means P was replaced
        if rec.migrations:
            rec.migrations[-1].to = p.name if rec.migrations[-1].role == "prefill" and not route.local_prefill else d.name
        if first:
            record_route(rec, route, self.picker.policy)
            rec.mark("dispatch")
        else:
            rec.decode_instance = d.name
        # Unique even when clients reuse request ids (X-Request-Id): P keys its sources by it.
        transfer_id = f"{rec.request_id}-{next(self._transfer_seq)}"
        # Each attempt is a new request to the engines: an aborted earlier one may still be
        # leaving P's engine, and two requests of one id there would take each other's blocks.
        engine_rid = rec.request_id if not rec.migrations else f"{rec.request_id}-moved-{len(rec.migrations)}"
        prefill = PrefillRequest(engine_rid, prompt_token_ids, sampling, transfer_id=transfer_id)
        stream, p_task, pre = None, None, None
        finished = got_token = False
        local_slot = contextlib.ExitStack()  # D's local prefill slot, held until the first token
        # P's load counts from the pick, before any await: a request right behind this one must
        # see it (counted only once P's call started, two requests a moment apart both saw an
        # idle P). Ends when P answers (_prefill_busy) or the attempt does.
        p_slot = contextlib.ExitStack()
        try:
            if not route.local_prefill:
                p_slot.enter_context(self.picker.prefilling(route, len(prompt_token_ids)))
            if route.local_prefill:  # D alone: no P, no transfer, D prefills what its cache lacks
                local_slot.enter_context(self.picker.prefilling_locally(route))
                stream = self._call(d, "decode", DecodeRequest(engine_rid, prompt_token_ids, sampling, None))
            elif self.transfer_mode == "push":
                # D first, with the handle the router can name in advance: D allocates its
                # blocks and asks P for them while P computes them. D's tokens need not wait
                # for P's answer: once D has every layer's KV, P's last layer's MLP, sampling
                # and reply are no business of D's.
                handle = TransferHandle(p.engine_id, p.kv_address, transfer_id, len(prompt_token_ids),
                                        self.transport).to_params()
                stream = self._call(d, "decode", DecodeRequest(engine_rid, prompt_token_ids, sampling, handle))
                p_task = asyncio.ensure_future(self._prefill_busy(route, prefill, deadline, p_slot))
            else:
                pre = await self._prefill_busy(route, prefill, deadline, p_slot)
                if first:
                    record_prefill(rec, pre, self._clock(p))
                stream = self._call(d, "decode", DecodeRequest(engine_rid, prompt_token_ids, sampling,
                                                               self._with_transport(pre.handle)))
            with self.picker.decoding(route, len(prompt_token_ids), sampling.max_tokens):
                while not finished:
                    # Once D has produced a token it holds every layer's KV: P's fate no longer matters.
                    delta = await self._next_delta_unless_p_fails(d, stream, deadline,
                                                                  None if got_token else p_task)
                    if delta is None:
                        raise BackendError(f"decode instance {d.name} ended {rec.request_id} without a finish", 502)
                    if delta.finish_reason in ("error", "abort") and not got_token and not route.local_prefill \
                            and await self._lost_soon(p, p_connection):
                        # D's KV load failed because P went away: a lost P before the first token.
                        raise InstanceLost("prefill", p.name, "it was lost while D loaded its KV")
                    record_tokens(rec, delta, self._clock(d))
                    if delta.new_token_ids:
                        got_token = True
                        local_slot.close()
                    finished = delta.finish_reason is not None
                    if finished:
                        if first:
                            record_decode_end(rec, delta, self._clock(d))
                        rec.finish_reason = delta.finish_reason
                        if p_task is not None and first:  # push: P's answer, for its hit and its timeline
                            pre = await self._p_answer(p_task)
                            if pre is not None:
                                record_prefill(rec, pre, self._clock(p))
                    yield self._chunk(route, pre.p_cached_tokens if pre else 0, delta)
        finally:
            local_slot.close()
            # P never answered (the attempt failed or ended first): out of P's load, its promise
            # of blocks not kept (the picker's `prefilling` marks P done only on a clean exit).
            p_slot.__exit__(BackendError, BackendError("P did not answer"), None)
            if p_task is not None and not p_task.done():
                p_task.cancel()
            if stream is not None:
                stream.cancel()  # unless it finished: aborts the request inside D's engine
            self.picker.ended(route)

    def _connection(self, inst: Instance) -> int:
        return getattr(self.channels.get(inst.name), "connections", 0)  # tests' fake channels: 0

    async def _lost_soon(self, inst: Instance, connection: int, within_s: float = LOST_GRACE_S) -> bool:
        """Whether the instance was lost since its channel's `connection`-th connection: it is down,
        goes down within `within_s` (a D reports a failed load from a killed P at about the moment
        the router's channel to P closes), or is already back as a new process."""
        deadline = time.monotonic() + within_s
        while self._channel_up(inst.name) and self._connection(inst) == connection:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    @staticmethod
    async def _p_answer(p_task: asyncio.Future) -> PrefillResult | None:
        """P's reply to a push, or None if P failed after D had its KV (D finished without it)."""
        try:
            return await p_task
        except BackendError as err:
            log.warning("P failed after D had every layer's KV (the request finished): %s", err)
            return None

    async def _prefill_busy(self, route: Route[Instance], req: PrefillRequest, deadline: float,
                            slot: contextlib.ExitStack) -> PrefillResult:
        """P's prefill; `slot` holds P's load (from the pick) and is closed when P answers."""
        with slot:
            pre = await self._prefill(route.prefill, req, deadline)
        engine = pre.engine
        if engine.scheduled_ns and engine.first_token_ns > engine.scheduled_ns:  # both on P's clock
            self.picker.prefilled(pre.p_cached_tokens, len(req.prompt_token_ids),
                                  (engine.first_token_ns - engine.scheduled_ns) / 1e9)
        return pre

    async def _next_delta_unless_p_fails(self, d: Instance, stream: PendingCall, deadline: float,
                                         p_task: asyncio.Future | None) -> DecodeDelta | None:
        """D's next delta; in push mode, P's failure (dead, timed out) ends the wait at once."""
        if p_task is None or p_task.done() and p_task.exception() is None:
            return await self._next_delta(d, stream, deadline)
        next_delta = asyncio.ensure_future(self._next_delta(d, stream, deadline))
        try:
            while not next_delta.done():
                await asyncio.wait({next_delta, p_task} if not p_task.done() else {next_delta},
                                   return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and p_task.exception() is not None:
                    raise p_task.exception()
            return next_delta.result()
        finally:
            next_delta.cancel()

    def _with_transport(self, params: dict | None) -> dict | None:
        """P's handle (pull mode), asking for this router's transport; other connectors' params as they are."""
        handle = TransferHandle.from_params(params)
        if handle is None or handle.transport == self.transport:
            return params
        return {**params, **dataclasses.replace(handle, transport=self.transport).to_params()}

    def _call(self, inst: Instance, method: str, req: PrefillRequest | DecodeRequest) -> PendingCall:
        try:
            return self.channels[inst.name].call(method, req)
        except EngineUnavailable as err:
            raise InstanceLost(method, inst.name, str(err)) from None

    async def _prefill(self, p: Instance, req: PrefillRequest, deadline: float) -> PrefillResult:
        call = self._call(p, "prefill", req)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):  # wait_for: a Task per await
                return await call.next()
        except TimeoutError:
            raise BackendError(f"prefill of {req.request_id} on {p.name} timed out after {self._timeout_s:.0f} s", 504,
                               "timeout") from None
        except EngineUnavailable as err:
            raise InstanceLost("prefill", p.name, str(err)) from None
        except EngineCallFailed as err:
            raise BackendError(f"prefill on {p.name} failed: {err}", 500) from None
        finally:
            call.cancel()  # unless it answered: aborts the prefill on P (timeout, client gone)

    async def _next_delta(self, d: Instance, stream: PendingCall, deadline: float) -> DecodeDelta | None:
        """D's next delta, merged with any that arrived behind it: under load, each delta the
        router handles (and each SSE event) costs ~60-125 us of its CPU (bench/README.md)."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):  # wait_for: a Task per await
                delta = await stream.next()
            while delta is not None and delta.finish_reason is None and stream.has_reply:
                later = await stream.next()  # returns at once
                delta = delta if later is None else delta.then(later)
            return delta
        except TimeoutError:
            raise BackendError(f"decode on {d.name} timed out after {self._timeout_s:.0f} s", 504, "timeout") from None
        except EngineUnavailable as err:
            raise InstanceLost("decode", d.name, str(err)) from None
        except EngineCallFailed as err:
            if str(err).startswith("EngineDeadError"):  # its vLLM core died: the actor is exiting
                raise InstanceLost("decode", d.name, str(err)) from None
            raise BackendError(f"decode on {d.name} failed: {err}", 500) from None

    @staticmethod
    def _chunk(route: Route[Instance], p_cached_tokens: int, delta: DecodeDelta) -> GenerationChunk:
        p, d = route.prefill, route.decode
        if delta.finish_reason in ("error", "abort"):
            if route.local_prefill:
                raise BackendError(f"decode on {d.name} ended with {delta.finish_reason!r}: D's own prefill of "
                                   f"the request failed or D aborted it", 502)
            raise BackendError(f"decode on {d.name} ended with {delta.finish_reason!r}: the KV transfer from "
                               f"{p.name} failed or D aborted the request", 502, "kv_transfer_error")
        t = delta.transfer
        final = delta.finish_reason is not None
        return GenerationChunk(
            new_token_ids=delta.new_token_ids, finish_reason=delta.finish_reason,
            p_cached_tokens=p_cached_tokens,
            # D prefilled it: D's own hit is all it had (the engine's count, on the last delta).
            d_cached_tokens=t.d_cached_tokens if t else (delta.num_cached_tokens if route.local_prefill and final else 0),
            transferred_tokens=t.transferred_tokens if t else 0,
            transfer_error=t.error if t else None,
            prefill_instance=(d.name if route.local_prefill else p.name) if final else None,
            local_prefill=route.local_prefill,
        )

    async def health(self) -> dict[str, bool]:
        async def one(inst: Instance) -> bool:
            try:
                healthy = await asyncio.wait_for(inst.actor.health.remote(), timeout=5.0)
            except Exception:  # dead, restarting, or engine unhealthy
                return False
            channel = self.channels.get(inst.name)
            return healthy and channel is not None and channel.connected

        insts = self.prefill + self.decode
        return dict(zip([i.name for i in insts], await asyncio.gather(*(one(i) for i in insts))))

