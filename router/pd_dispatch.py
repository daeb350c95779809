"""The P/D request path over real channels: the asyncio driver of router/lifecycle.py.

`PDDispatcher` implements `TokenBackend` over each engine actor's request channel
(transfer/request_channel.py; Ray only places and watches the actors). The sequence of a
request (pick, push / pull / local prefill, decode, moves off lost instances, the record) is
the lifecycle's; this module turns its commands into calls, and replies, failures and the
request's deadline into its inputs. Nothing waits forever: every wait is bounded by the
deadline, and on any exit path the calls still running are aborted, which aborts them in vLLM.

Each request leaves a RequestRecord (router/timeline.py), handed to the record sinks when it
ends, however it ends. Recording is best effort for the request: a sink that raises (a full
disk, a lost permission) is counted and logged once per sink, and the request goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import ray

from pdcluster.proto.messages import DecodeDelta, InstanceInfo, RefusalCounts, SamplingSpec, TierCounts
from pdcluster.proto.router_spec import DEFAULT_MIGRATION_LIMIT, LocalPrefillSpec, Policy
from pdcluster.router.admission import AdmissionLimits
from pdcluster.router.backend import BackendError, GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import (
    Abort,
    CheckLost,
    Decode,
    Emit,
    Failure,
    Finished,
    Lifecycle,
    OpenPool,
    Prefill,
    Routed,
)
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.prefill_cost import PrefillCost
from pdcluster.router.recording import RecordSink
from pdcluster.router.routing import InstancePicker, PrefixLookup
from pdcluster.router.timeline import ClockOffset
from pdcluster.transfer.request_channel import EngineCallFailed, EngineChannel, EngineUnavailable, PendingCall

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

    @classmethod
    def of(cls, info: InstanceInfo, actor: ray.actor.ActorHandle) -> Instance:
        """The instance `info` describes, reached through `actor`."""
        return cls(info.name, actor, info.engine_id, info.kv_address)


class PDDispatcher(TokenBackend):
    def __init__(self, prefill: list[Instance], decode: list[Instance], card: ModelCard, request_timeout_s: float,
                 sinks: list[RecordSink] | None = None, transfer_mode: str = "pull", transport: str = "grpc",
                 policy: Policy = "round_robin", block_size: int = 128, lookup: PrefixLookup | None = None,
                 channels: dict[str, EngineChannel] | None = None, pending: PendingBlocks | None = None,
                 cost: PrefillCost | None = None, local: LocalPrefillSpec | None = None,
                 admission: AdmissionLimits | None = None, migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                 p_pool: bool = False):
        assert prefill and decode, "a P/D cluster needs at least one P and one D instance"
        assert transfer_mode == "pull" or all(p.kv_address for p in prefill), (
            "push mode needs every P's KV address (InstanceInfo.kv_address)")
        self.prefill, self.decode = prefill, decode
        self._card = card
        self._last_answers: dict[tuple[str, str], object] = {}  # (method, instance) -> its last answer (_ask_each)
        self._timeout_s = request_timeout_s
        # Only instances whose channel is up get new requests: a dead host's are skipped from
        # the moment its connection ends (its FIN, keepalive, or Ray's word) until it is back.
        self.picker = InstancePicker(policy, prefill, decode, block_size, lookup, is_up=self._channel_up,
                                     pending=pending, cost=cost, local=local, p_pool=p_pool)
        # The lifecycle's shared part (router/lifecycle.py): transfer settings, admission
        # (None: every request is taken in), moves per request off lost instances.
        self.core = Dispatch(self.picker, transfer_mode, transport, request_timeout_s, migration_limit, admission,
                             clock_of=lambda name: self.clocks.get(name, ClockOffset(0, 0)))
        self.sinks: list[RecordSink] = list(sinks or [])
        self.begin_sinks: list[RecordSink] = []  # hear each record as its request comes in (the run's journal)
        self.stopping = False  # the router is stopping: requests still running are ended by it
        self.rejection_listeners: list[Callable[[str], None]] = []  # each 429's reason (the metrics)
        self.sink_failure_listeners: list[Callable[[str], None]] = []  # the failing sink's name, each time
        self._failed_sinks: set[str] = set()  # logged once each
        # Instance clock - router clock; instances not measured count as on this clock.
        self.clocks: dict[str, ClockOffset] = {}
        # Instance name -> its request channel (connect_channels; tests pass fakes).
        self.channels: dict[str, EngineChannel] = dict(channels or {})
        # Instance name -> its InstanceInfo as of its channel's last (re)connection.
        self.infos: dict[str, InstanceInfo] = {}
        self.instance_listeners: list[Callable[[InstanceInfo], None]] = []  # hear every refreshed InstanceInfo

    # The settings users change at run time (router/server.py), kept by the lifecycle's core.
    transfer_mode = property(lambda self: self.core.transfer_mode,
                             lambda self, mode: setattr(self.core, "transfer_mode", mode))
    transport = property(lambda self: self.core.transport,  # grpc | torch_dist, per transfer (the handle names it)
                         lambda self, transport: setattr(self.core, "transport", transport))
    accepted_in_flight = property(lambda self: self.core.in_flight,  # requests taken in and not finished
                                  lambda self, n: setattr(self.core, "in_flight", n))

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

    def model_card(self) -> ModelCard:
        return self._card

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                       arrival_ns: int | None = None, traceparent: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Drives the request's lifecycle (router/lifecycle.py): its commands become calls on the
        engines' channels, the replies, failures and the deadline its inputs."""
        self.admit()  # before anything is recorded or routed: a refused request costs nothing more
        lc = Lifecycle(self.core, request_id, prompt_token_ids, sampling,
                       time.monotonic_ns() if arrival_ns is None else arrival_ns)
        lc.rec.traceparent = traceparent
        self._hear(self.begin_sinks, lc.rec)
        deadline = time.monotonic() + self._timeout_s
        calls = _Calls()
        try:
            queue = deque(lc.start(time.monotonic_ns()))
            while True:
                while queue:
                    cmd = queue.popleft()
                    if isinstance(cmd, Emit):
                        yield cmd.chunk
                    elif isinstance(cmd, Finished):
                        if cmd.error is not None:
                            raise cmd.error
                        return
                    elif isinstance(cmd, Routed):
                        calls = _Calls(cmd.attempt, self._connection(cmd.route.prefill))
                    elif isinstance(cmd, Abort):
                        if cmd.attempt == calls.attempt:
                            calls.abort()
                    elif cmd.attempt == calls.attempt:  # not of an attempt that ended meanwhile
                        queue.extendleft(reversed(await self._start(lc, calls, cmd)))
                queue.extend(await self._next_input(lc, calls, deadline))
        except (GeneratorExit, asyncio.CancelledError):
            lc.cancel(self.stopping)
            raise
        finally:
            calls.abort()  # unless they ended: aborts the request inside P's and D's engines
            self._hear(self.sinks, lc.close(time.monotonic_ns()))

    def admit(self) -> None:
        rejection = self.core.admit()
        if rejection is not None:
            for listener in self.rejection_listeners:
                listener(rejection.reason)
            raise BackendError(rejection.message, 429, "rate_limit_exceeded", rejection.retry_after_s)

    def _hear(self, sinks: list[RecordSink], rec) -> None:
        for sink in sinks:
            try:
                sink(rec)
            except Exception as err:  # the request was served: its record is not worth failing it
                name = getattr(sink, "__qualname__", repr(sink))
                if name not in self._failed_sinks:
                    self._failed_sinks.add(name)
                    log.error("record sink %s failed (counted in pdc_record_failures_total from now on, "
                              "logged once): %r", name, err)
                for listener in self.sink_failure_listeners:
                    listener(name)

    async def _start(self, lc: Lifecycle, calls: _Calls, cmd: Prefill | OpenPool | Decode | CheckLost) -> list:
        """One of the lifecycle's calls; the lifecycle's answer if it failed at once."""
        if isinstance(cmd, CheckLost):
            return lc.p_lost(cmd.attempt, await self._lost_soon(cmd.instance, calls.p_connection), time.monotonic_ns())
        method, fed = {Prefill: ("prefill", lc.prefill_failed), OpenPool: ("open_pool", lc.pool_failed),
                       Decode: ("decode", lc.decode_failed)}[type(cmd)]
        try:
            call = self.channels[cmd.instance.name].call(method, cmd.request)
        except EngineUnavailable as err:
            return fed(cmd.attempt, Failure("lost", str(err)), time.monotonic_ns())
        if isinstance(cmd, OpenPool):
            calls.pool_call = call
        elif isinstance(cmd, Prefill):
            calls.p_call, calls.p_answer = call, asyncio.ensure_future(call.next())
        else:
            calls.d_stream = call
        return []

    async def _next_input(self, lc: Lifecycle, calls: _Calls, deadline: float) -> list:
        """Wait for what the lifecycle waits for (P's answer, D's next output, or both) until the
        deadline, and feed it."""
        attempt, want_p, want_d = calls.attempt, lc.waiting_for_prefill, lc.waiting_for_decode
        remaining = max(0.0, deadline - time.monotonic())
        if lc.waiting_for_pool:  # nothing else runs meanwhile
            try:
                async with asyncio.timeout(remaining):
                    offer = await calls.pool_call.next()
            except TimeoutError:
                return lc.timed_out(time.monotonic_ns())
            except (EngineUnavailable, EngineCallFailed) as err:
                return lc.pool_failed(attempt, _failure(err), time.monotonic_ns())
            if offer is None:
                return lc.pool_failed(attempt, Failure("error", "it ended the call without an answer"),
                                      time.monotonic_ns())
            return lc.pool_opened(attempt, offer, time.monotonic_ns())
        assert want_p or want_d, f"{lc.rec.request_id}: the lifecycle waits for nothing and is not finished"
        if want_d and not want_p and calls.d_next is None:  # the stream alone: no Task per delta
            try:
                async with asyncio.timeout(remaining):  # wait_for: a Task per await
                    delta = await self._next_delta(calls.d_stream)
            except TimeoutError:
                return lc.timed_out(time.monotonic_ns())
            except (EngineUnavailable, EngineCallFailed) as err:
                return lc.decode_failed(attempt, _failure(err), time.monotonic_ns())
            return lc.decode_output(attempt, delta, time.monotonic_ns())
        waits = {calls.p_answer} if want_p else set()
        if want_d:
            if calls.d_next is None:
                calls.d_next = asyncio.ensure_future(self._next_delta(calls.d_stream))
            waits.add(calls.d_next)
        done, _ = await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        now = time.monotonic_ns()
        if not done:
            return lc.timed_out(now)
        out = []
        if calls.p_answer in done:  # P first: its answer may decide what D's output means
            try:
                result = calls.p_answer.result()
            except (EngineUnavailable, EngineCallFailed) as err:
                out += lc.prefill_failed(attempt, _failure(err), now)
            else:
                out += (lc.prefill_answered(attempt, result, now) if result is not None
                        else lc.prefill_failed(attempt, Failure("error", "P ended the call without an answer"), now))
        if calls.d_next in done and lc.attempt is not None and lc.attempt.number == attempt and lc.waiting_for_decode:
            d_next, calls.d_next = calls.d_next, None
            try:
                out += lc.decode_output(attempt, d_next.result(), now)
            except (EngineUnavailable, EngineCallFailed) as err:
                out += lc.decode_failed(attempt, _failure(err), now)
        return out

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
    async def _next_delta(stream: PendingCall) -> DecodeDelta | None:
        """D's next delta, merged with any that arrived behind it: under load, each delta the
        router handles (and each SSE event) costs it CPU (bench/README.md)."""
        delta = await stream.next()
        while delta is not None and delta.finish_reason is None and stream.has_reply:
            later = await stream.next()  # returns at once
            if later is None:
                break
            if not delta.joins(later):  # another choice's (n > 1), or this one ended: the next call's
                stream.push_back(later)
                break
            delta = delta.then(later)
        return delta

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

    async def refusals(self) -> dict[str, RefusalCounts]:
        """Each instance's refused peers per plane."""
        return await self._ask_each("refusals")

    async def tier_counts(self) -> dict[str, TierCounts]:
        """Each instance's host tier's own counts (instances without a tier left out)."""
        return await self._ask_each("tier_counts")

    async def _ask_each(self, method: str, timeout_s: float = 1.0) -> dict:
        """Each instance's answer to a Ray call of `method`. One that does not answer in `timeout_s`
        (a P in a long prefill step answers a tier's counts only after it) gives its last answer,
        so that a scrape neither waits for the step nor sees its counters vanish; one that is down,
        or answers None, is left out (its counts show again when it answers)."""
        async def one(inst: Instance):
            key = (method, inst.name)
            try:
                answer = await asyncio.wait_for(getattr(inst.actor, method).remote(), timeout_s)
            except Exception:
                return self._last_answers.get(key) if self._channel_up(inst.name) else None
            self._last_answers[key] = answer
            return answer

        insts = self.prefill + self.decode
        counts = await asyncio.gather(*(one(i) for i in insts))
        return {i.name: c for i, c in zip(insts, counts) if c is not None}



@dataclass
class _Calls:
    """The running attempt's calls: what the lifecycle's Abort ends."""

    attempt: int = -1
    p_connection: int = 0  # P's channel's connection count at the pick: another one later means P was replaced
    pool_call: PendingCall | None = None  # the pool's holder's offer (before D is asked)
    p_call: PendingCall | None = None
    p_answer: asyncio.Future | None = None  # P's reply, awaited beside D's stream
    d_stream: PendingCall | None = None
    d_next: asyncio.Future | None = None  # D's next delta, while P's answer is awaited too

    def abort(self) -> None:
        for task in (self.p_answer, self.d_next):
            if task is not None and not task.done():
                task.cancel()
        for call in (self.pool_call, self.p_call, self.d_stream):
            if call is not None:
                call.cancel()  # unless it ended: aborts the request inside the engine


def _failure(err: EngineUnavailable | EngineCallFailed) -> Failure:
    return Failure("lost", str(err)) if isinstance(err, EngineUnavailable) else Failure("error", str(err))
