"""The router on the virtual clock: router/pd_dispatch.py's request path, without the network.

What decides is the router's own code: `InstancePicker` (router/routing.py) with the spec's
policy, pending blocks (router/pending_blocks.py), prefill-cost model (router/prefill_cost.py)
and local-prefill rule; admission (router/admission.py); one `InstanceIndex` per instance
(router/prefix_index.py) fed every KV cache event its pool publishes. The real router gets
those events over ZMQ a moment after each step; here they are applied at the step's end.
Records are filled by router/recording.py from the same messages the engines send
(PrefillResult, DecodeDelta, TransferStats), every time on the virtual clock.

Request path, as the dispatcher's: push mode sends D and P the request at once (D starts
its load when its scheduler admits it, and takes each block as P makes it ready); pull mode
sends D the request when P is done; a route that prefills on D sends D alone. Not modelled:
network and router CPU time (a request reaches P and D the moment it arrives), failures,
migrations, timeouts, client aborts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from pdcluster.cluster.messages import DecodeDelta, EngineTimes, PrefillResult
from pdcluster.cluster.sim import kv_wire
from pdcluster.cluster.sim.request import Delta, SimRequest
from pdcluster.cluster.sim.virtual.events import EventLoop
from pdcluster.cluster.sim.virtual.instance import VirtualInstance
from pdcluster.cluster.sim.virtual.kv import VirtualKv
from pdcluster.cluster.sim.virtual.prompts import PreparedPrompt
from pdcluster.cluster.spec import ClusterSpec
from pdcluster.router.admission import AdmissionLimits, admit
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.prefill_cost import prefill_cost
from pdcluster.router.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, InstanceIndex, RouterHash
from pdcluster.router.recording import record_decode_end, record_prefill, record_route, record_tokens
from pdcluster.router.routing import InstancePicker, Route
from pdcluster.router.timeline import ClockOffset, RequestRecord

SAME_CLOCK = ClockOffset(0, 0)


class _SameHashes(Mapping):
    """Engine hash -> router hash, where they are one: the virtual pools key their blocks by the
    router's chain (prompts.py, VirtualScheduler.hash_blocks) and their events carry those keys,
    so an index takes each stored block's hash as it is instead of hashing its tokens."""

    def __getitem__(self, engine_hash: bytes) -> RouterHash:
        return engine_hash

    def get(self, engine_hash: bytes, default: RouterHash | None = None) -> RouterHash:
        return engine_hash

    def __iter__(self) -> Iterator[RouterHash]:
        return iter(())

    def __len__(self) -> int:
        return 0


_SAME_HASHES = _SameHashes()


class _IndexLookup:
    """router/routing.py's PrefixLookup over the instances' indexes (the KV-event feed's role)."""

    def __init__(self, indexes: dict[str, InstanceIndex]):
        self.indexes = indexes

    def matched_blocks(self, instance: str, hashes: list[RouterHash]) -> int:
        return self.indexes[instance].matched_blocks(hashes)

    def clears(self, instance: str) -> int:
        return self.indexes[instance].clears

    def holds(self, instance: str, block: RouterHash) -> bool:
        return self.indexes[instance].holds(block)

    def stale(self, instance: str) -> bool:
        return self.indexes[instance].stale


def index_events(events: list) -> list:
    """A pool's events (cluster/sim/kv_wire.py, vLLM's structs) as the index reads them
    (router/kv_event_wire.py decodes the same fields off the wire)."""
    out = []
    for ev in events:  # the pool's lists are the index's to read (nothing else holds them): not copied
        assert not getattr(ev, "block_hashes", None) or isinstance(ev.block_hashes[0], bytes), (
            "a pool publishing vLLM's int hashes: the indexes take the events' hashes as the router's (int_hashes)")
        if isinstance(ev, kv_wire.BlockStored):
            out.append(BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                                   ev.group_idx or 0, ev.medium, None))
        elif isinstance(ev, kv_wire.BlockRemoved):
            out.append(BlockRemoved(ev.block_hashes, ev.group_idx or 0, ev.medium))
        else:
            out.append(AllBlocksCleared())
    return out


class DeltaSink:
    """Where a SimRequest's deltas go (its `out`): straight to a callback."""

    def __init__(self, on_delta: Callable[[Delta], None]):
        self.put_nowait = on_delta


@dataclass
class _Flight:
    """One request between its arrival and its end."""

    rec: RequestRecord
    route: Route
    prompt: PreparedPrompt
    max_tokens: int
    on_done: Callable[[RequestRecord], None]
    p_req: SimRequest | None = None
    d_req: SimRequest | None = None
    prefilling: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    decoding: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class VirtualRouter:
    def __init__(self, spec: ClusterSpec, loop: EventLoop, prefill: list[VirtualInstance],
                 decode: list[VirtualInstance], kv: VirtualKv):
        self.spec, self.loop, self.kv = spec, loop, kv
        self.instances = {i.name: i for i in [*prefill, *decode]}
        self.block_size = spec.role_engine("prefill").block_size
        self.indexes = {name: InstanceIndex(self.block_size, known=_SAME_HASHES) for name in self.instances}
        self._seq = dict.fromkeys(self.instances, 0)
        r = spec.router
        self.picker = InstancePicker(r.policy, prefill, decode, self.block_size, _IndexLookup(self.indexes),
                                     pending=PendingBlocks() if r.track_pending else None, clock=loop.now_s,
                                     cost=prefill_cost(spec), local=r.local_prefill)
        self.push = spec.transfer.mode == "push"
        self.admission = AdmissionLimits.settle(
            r.admission, decode_slots=len(decode) * spec.role_engine("decode").max_num_seqs,
            request_timeout_s=r.request_timeout_s)
        self.in_flight = 0

    def kv_events(self, instance: str) -> Callable[[list], None]:
        """The callback an instance's scheduler publishes its pool's events to."""
        def apply(events: list) -> None:
            self.indexes[instance].apply(self._seq[instance], index_events(events))
            self._seq[instance] += 1
        return apply

    # -- one request

    def submit(self, request_id: str, prompt: PreparedPrompt, max_tokens: int,
               on_done: Callable[[RequestRecord], None]) -> None:
        """A request arrives now; on_done gets its record when it ends (`error` set if refused)."""
        now = self.loop.now_ns
        rec = RequestRecord(request_id, prompt_tokens=len(prompt.tokens))
        rec.mark("arrival", now)
        rejection = admit(self.admission, self.in_flight, self.picker.least_queued_s())
        if rejection is not None:
            rec.error = f"429: {rejection.message}"
            rec.mark("finish", now)
            on_done(rec)
            return
        self.in_flight += 1
        route = self.picker.pick(prompt.tokens, max_tokens, hashes=prompt.router_hashes)
        record_route(rec, route, self.picker.policy)
        rec.mark("dispatch", now)
        flight = _Flight(rec, route, prompt, max_tokens, on_done)
        n = len(prompt.tokens)
        if route.local_prefill:  # D alone prefills what its cache lacks, until its first token
            flight.prefilling.enter_context(self.picker.prefilling_locally(route))
            self._send_decode(flight, external=False)
            return
        # Before P computes anything: P's steps make D's blocks ready from the first one.
        self.kv.expect(f"{request_id}#d", n, route.prefill.name, f"{request_id}#p", route.decode.name,
                       f"{request_id}#d")
        if self.push:
            self._send_decode(flight, external=True)
        flight.prefilling.enter_context(self.picker.prefilling(route, n))
        flight.p_req = self._sim_request(flight, f"{request_id}#p", 1, 0, lambda d: self._p_delta(flight, d))
        self.instances[route.prefill.name].add(flight.p_req)

    def _sim_request(self, flight: _Flight, rid: str, max_tokens: int, external: int,
                     on_delta: Callable[[Delta], None]) -> SimRequest:
        p = flight.prompt
        return SimRequest(rid, p.tokens, max_tokens, ignore_eos=True, external_tokens=external, id_range=p.id_range,
                          block_hashes=p.block_hashes, out=DeltaSink(on_delta))

    def _send_decode(self, flight: _Flight, external: bool) -> None:
        route, n = flight.route, len(flight.prompt.tokens)
        rid = f"{flight.rec.request_id}#d"
        flight.d_req = self._sim_request(flight, rid, flight.max_tokens, n if external else 0,
                                         lambda d: self._d_delta(flight, d))
        flight.decoding.enter_context(self.picker.decoding(route, n, flight.max_tokens))
        self.instances[route.decode.name].add(flight.d_req)

    def _p_delta(self, flight: _Flight, delta: Delta) -> None:
        if delta.finish_reason is None:
            return
        sreq, n = flight.p_req, len(flight.prompt.tokens)
        engine = EngineTimes(sreq.queued_ns, sreq.scheduled_ns, sreq.first_token_ns)
        record_prefill(flight.rec, PrefillResult(flight.rec.request_id, None, n, max(0, sreq.num_cached_tokens),
                                                 engine), SAME_CLOCK)
        flight.prefilling.close()
        if engine.scheduled_ns and engine.first_token_ns > engine.scheduled_ns:
            self.picker.prefilled(max(0, sreq.num_cached_tokens), n,
                                  (engine.first_token_ns - engine.scheduled_ns) / 1e9)
        if not self.push:
            self._send_decode(flight, external=True)

    def _d_delta(self, flight: _Flight, delta: Delta) -> None:
        rec, now = flight.rec, self.loop.now_ns
        out = DecodeDelta(delta.token_ids, token_ns=delta.token_ns)
        record_tokens(rec, out, SAME_CLOCK, now)
        if delta.token_ids and flight.route.local_prefill:
            flight.prefilling.close()  # D's local slot: until its first token
        if delta.finish_reason is None:
            return
        sreq = flight.d_req
        stats = self.kv.stats(sreq.request_id)
        cached = max(0, sreq.num_cached_tokens)
        if stats is not None:
            stats = dataclasses.replace(stats, kv_ready_ns=sreq.kv_ready_ns)
            if stats.error is None:
                cached = stats.d_cached_tokens + stats.transferred_tokens
        last = DecodeDelta([], delta.finish_reason, stats, cached,
                           EngineTimes(sreq.queued_ns, sreq.scheduled_ns, sreq.first_token_ns))
        record_decode_end(rec, last, SAME_CLOCK)
        if delta.finish_reason in ("error", "abort"):
            rec.error = (f"decode on {flight.route.decode.name} ended with {delta.finish_reason!r}: "
                         + (stats.error if stats is not None and stats.error else "D's own prefill failed"))
        flight.decoding.close()
        flight.prefilling.close()
        self.picker.ended(flight.route)
        self.in_flight -= 1
        rec.mark("finish", now)
        flight.on_done(rec)
