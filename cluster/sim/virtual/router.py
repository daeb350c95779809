"""The router on the virtual clock: a driver of router/lifecycle.py, without the network.

The request's sequence is the lifecycle's, as the real router's (router/pd_dispatch.py); what
decides is the router's own code: `InstancePicker` (router/routing.py) with the spec's policy,
pending blocks, prefill-cost model and local-prefill rule; admission; one `InstanceIndex` per
instance (router/prefix_index.py) fed every KV cache event its pool publishes. The real router
gets those events over ZMQ a moment after each step; here they are applied at the step's end.
The lifecycle's commands become SimRequests added to the virtual instances (push: D and P at
once, D loading each block as P makes it ready; pull: D when P is done; local prefill: D alone,
reading first what a P's tier offers when the route reads the pool),
and their deltas its inputs, every time on the virtual clock. Not modelled: network and router
CPU time (a request reaches P and D the moment it arrives), failures, migrations, timeouts,
client aborts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from pdcluster.cluster.launch import prefill_cost
from pdcluster.cluster.sim import kv_wire
from pdcluster.cluster.sim.request import Delta, SimRequest
from pdcluster.cluster.sim.tier import tier_load_ns
from pdcluster.cluster.sim.virtual.events import EventLoop
from pdcluster.cluster.sim.virtual.instance import VirtualInstance
from pdcluster.cluster.sim.virtual.kv import VirtualKv
from pdcluster.cluster.sim.virtual.prompts import PreparedPrompt
from pdcluster.proto.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored
from pdcluster.proto.messages import DecodeDelta, EngineTimes, PoolOffer, PrefillResult, SamplingSpec
from pdcluster.proto.spec import ClusterSpec
from pdcluster.router.admission import AdmissionLimits
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import CheckLost, Command, Decode, Finished, Lifecycle, OpenPool, Prefill, Routed
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.prefix_index import InstanceIndex, RouterHash
from pdcluster.router.routing import InstancePicker
from pdcluster.router.timeline import RequestRecord


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

    def tier_matched_blocks(self, instance: str, hashes: list[RouterHash], start: int) -> int:
        return self.indexes[instance].tier_matched_blocks(hashes, start)

    def clears(self, instance: str) -> int:
        return self.indexes[instance].clears

    def holds(self, instance: str, block: RouterHash) -> bool:
        return self.indexes[instance].holds(block)

    def removals(self, instance: str) -> int:
        return self.indexes[instance].removed_blocks

    def removed_since(self, instance: str, block: RouterHash, removals: int) -> bool:
        return self.indexes[instance].removed_since(block, removals)

    def stale(self, instance: str) -> bool:
        return self.indexes[instance].stale


def index_events(events: list) -> list:
    """A pool's events (cluster/sim/kv_wire.py, vLLM's structs) as the index reads them
    (proto/kv_event_wire.py decodes the same fields off the wire)."""
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
    """One request between its arrival and its end: its lifecycle and the engines' requests."""

    lc: Lifecycle
    prompt: PreparedPrompt
    on_done: Callable[[RequestRecord], None]
    p_req: SimRequest | None = None
    d_req: SimRequest | None = None
    attempt: int = -1


class VirtualRouter:
    """A driver of router/lifecycle.py on the virtual clock: commands become SimRequests added
    to the instances, their deltas the lifecycle's inputs."""

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
                                     cost=prefill_cost(spec), local=r.local_prefill, p_pool=r.p_pool)
        self.dispatch = Dispatch(self.picker, transfer_mode=spec.transfer.mode,
                                 request_timeout_s=r.request_timeout_s, migration_limit=r.migration_limit,
                                 admission=AdmissionLimits.settle(
                                     r.admission, decode_slots=len(decode) * spec.role_engine("decode").max_num_seqs,
                                     request_timeout_s=r.request_timeout_s))

    @property
    def in_flight(self) -> int:
        return self.dispatch.in_flight

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
        rejection = self.dispatch.admit()
        if rejection is not None:  # the real router answers 429 and keeps no record; the client counts it
            rec = RequestRecord(request_id, prompt_tokens=len(prompt.tokens))
            rec.mark("arrival", now)
            rec.error = f"429: {rejection.message}"
            rec.mark("finish", now)
            on_done(rec)
            return
        lc = Lifecycle(self.dispatch, request_id, prompt.tokens, SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
                       now, hashes=prompt.router_hashes)
        flight = _Flight(lc, prompt, on_done)
        self._do(flight, lc.start(now))

    def _do(self, flight: _Flight, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, Routed):
                flight.attempt, route = cmd.attempt, cmd.route
                if not route.local_prefill:  # before P computes anything: P's steps make D's blocks ready
                    rid = flight.lc.rec.request_id
                    self.kv.expect(f"{rid}#d", len(flight.prompt.tokens), route.prefill.name, f"{rid}#p",
                                   route.decode.name, f"{rid}#d")
            elif isinstance(cmd, Prefill):  # with the pool's handle: P loads the holder's run first
                external = cmd.request.pool.num_tokens if cmd.request.pool is not None else 0
                flight.p_req = self._sim_request(flight, "p", 1, external, lambda d: self._p_delta(flight, d))
                self.instances[cmd.instance.name].add(flight.p_req)
            elif isinstance(cmd, OpenPool):  # the holder's tier offers its run at once (no network modelled)
                tier = self.instances[cmd.instance.name].core.tier
                offer = PoolOffer(cmd.request.transfer_id,
                                  tier.offer(flight.prompt.block_hashes, len(flight.prompt.tokens)) if tier else 0)
                if offer.num_tokens:  # the reader: D for a local prefill, else P
                    rid, route = flight.lc.rec.request_id, flight.lc.attempt.route
                    reader = (route.decode.name, f"{rid}#d") if route.local_prefill else (route.prefill.name, f"{rid}#p")
                    self.kv.expect_pool(offer.transfer_id, offer.num_tokens, cmd.instance.name, *reader)
                self._do(flight, flight.lc.pool_opened(cmd.attempt, offer, self.loop.now_ns))
            elif isinstance(cmd, Decode):
                # The prompt's KV comes from P (or a P's tier) for what the request's handle covers.
                external = cmd.request.handle.num_tokens if cmd.request.handle is not None else 0
                flight.d_req = self._sim_request(flight, "d", cmd.request.sampling.max_tokens, external,
                                                 lambda d: self._d_delta(flight, d))
                self.instances[cmd.instance.name].add(flight.d_req)
            elif isinstance(cmd, CheckLost):  # no failures modelled: P is never lost
                self._do(flight, flight.lc.p_lost(cmd.attempt, False, self.loop.now_ns))
            elif isinstance(cmd, Finished):
                flight.on_done(flight.lc.close(self.loop.now_ns))
            # Abort: nothing runs on after its attempt here. Emit: the client reads the record.

    def _sim_request(self, flight: _Flight, role: str, max_tokens: int, external: int,
                     on_delta: Callable[[Delta], None]) -> SimRequest:
        p = flight.prompt
        return SimRequest(f"{flight.lc.rec.request_id}#{role}", p.tokens, max_tokens, ignore_eos=True,
                          external_tokens=external, id_range=p.id_range, block_hashes=p.block_hashes,
                          out=DeltaSink(on_delta))

    def _p_delta(self, flight: _Flight, delta: Delta) -> None:
        if delta.finish_reason is None:
            return
        sreq = flight.p_req
        engine = EngineTimes(sreq.queued_ns, sreq.scheduled_ns, sreq.first_token_ns)
        pool = self.kv.stats(sreq.request_id)  # P's read of a peer's tier, if it read one
        read = pool.transferred_tokens if pool is not None and pool.error is None else 0
        result = PrefillResult(flight.lc.rec.request_id, None, len(flight.prompt.tokens),
                               max(0, sreq.num_cached_tokens) + read, engine, p_tier_tokens=sreq.num_tier_tokens,
                               p_tier_load_ns=tier_load_ns(self.instances[flight.lc.attempt.route.prefill.name].core.tier,
                                                           sreq), p_pool_tokens=read, p_pool=pool)
        self._do(flight, flight.lc.prefill_answered(flight.attempt, result, self.loop.now_ns))

    def _d_delta(self, flight: _Flight, delta: Delta) -> None:
        if delta.finish_reason is None:
            out = DecodeDelta(delta.token_ids, token_ns=delta.token_ns)
        else:  # the last: D's engine times, and the transfer as D's connector reports it
            sreq = flight.d_req
            stats = self.kv.stats(sreq.request_id)
            cached = max(0, sreq.num_cached_tokens)
            if stats is not None:
                stats = dataclasses.replace(stats, kv_ready_ns=sreq.kv_ready_ns)
                if stats.error is None:
                    cached = stats.d_cached_tokens + stats.transferred_tokens
            out = DecodeDelta(delta.token_ids, delta.finish_reason, stats, cached,
                              EngineTimes(sreq.queued_ns, sreq.scheduled_ns, sreq.first_token_ns),
                              token_ns=delta.token_ns)
        self._do(flight, flight.lc.decode_output(flight.attempt, out, self.loop.now_ns))
