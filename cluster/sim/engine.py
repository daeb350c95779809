"""One simulated P or D instance: a Ray actor with exactly EngineActor's methods and messages.

`SimEngineActor` stands where cluster/engine_actor.py's EngineActor stands (the
launcher picks it for `engine: sim`), so the router, timelines and benches use
it unchanged. Only model execution is replaced: the scheduler (scheduler.py)
sleeps each step for the cost model's time (cost.py). Everything around it is
real: a prefix cache with vLLM's hashing and LRU (block_pool.py), its KV cache
events published in vLLM's wire format, by ZmqEventPublisher's protocol, on the
instance's `kv_event_ports` (kv_wire.py: vLLM restated, not imported: a
simulated instance starts in ~2.4 CPU-s and ~250 MB instead of ~8.4 and ~580), and the P -> D transfer through the project's KvServer /
KvFetcher over a PagedKv of the instance's own (scaled) state (payload.py,
producer.py, consumer.py).

P's `prefill` returns a TransferHandle (P keeps the blocks until D releases
them or the lease ends). D's `decode` takes the handle, pulls what its own
cache lacks, waits out the modelled transfer, then streams its tokens in
batched deltas (`DecodeDelta.token_ns` carries each token's time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from pdcluster.cluster.sim.block_pool import BlockPool
from pdcluster.cluster.sim.consumer import ConsumerSide, RecordingPagedKv
from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.cluster.sim.kv_wire import EventPublisher, KVEventBatch, int_block_hashes
from pdcluster.cluster.sim.payload import component_rows_bytes, make_paged_kv
from pdcluster.cluster.sim.producer import PrefillSide, ProducerSide
from pdcluster.cluster.sim.request import SimRequest
from pdcluster.cluster.sim.scheduler import Scheduler, SchedulerConfig
from pdcluster.cluster.sim.tier import host_tier, tier_load_ns
from pdcluster.cluster.sim.variation import StepVariation
from pdcluster.cluster.sim.vocab import model_vocab
from pdcluster.cluster.start_diagnosis import check_ports_free, listen_ports
from pdcluster.proto.engine import Engine
from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    EngineLoad,
    EngineTimes,
    InstanceInfo,
    PoolOffer,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    Role,
    TierCounts,
)
from pdcluster.proto.spec import ClusterSpec
from pdcluster.transfer.channel_server import ServesRequestChannel
from pdcluster.transfer.network import host_port, instance_address, instance_planes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimStats:
    received_bytes: int  # scaled payload bytes its pulls wrote, over transport grpc (P: its reads of peers' tiers)
    payload_bytes_per_block: dict[str, int]  # per component: one block's bytes on the wire
    steps: int
    lag_resets: int  # steps that started more than max_lag_s late: the CPU could not keep up


class SimEngineActor(ServesRequestChannel, Engine):
    """Ray actor body (wrapped with ray.remote by the launcher)."""

    def __init__(self, spec: ClusterSpec, role: Role, index: int):
        t0 = time.time()
        assert spec.sim is not None, "engine: sim without a sim: section (spec validation should have caught it)"
        import ray

        self.spec, self.role, self.index = spec, role, index
        self.address = instance_address(spec.network, ray.util.get_node_ip_address())
        check_ports_free(listen_ports(spec, role, index, self.address.bind))
        eng = spec.role_engine(role)
        self.name = f"{role}-{index}"
        self.engine_id = f"{spec.name}-{self.name}"
        self.cost = CostModel(SimParams.load(spec.sim.params), eng.block_size, spec.sim.devices_per_instance)
        components = self.cost.components
        num_blocks = (spec.sim.kv_blocks_of(role) or self.cost.kv_capacity_blocks()) + 1  # + vLLM's null block
        vocab, eos = model_vocab(spec.model.path)
        self.config = SchedulerConfig(
            block_size=eng.block_size, max_num_batched_tokens=eng.max_num_batched_tokens,
            max_num_seqs=eng.max_num_seqs, max_model_len=eng.max_model_len, vocab_size=vocab, eos_token_id=eos,
            long_prefill_token_threshold=int(eng.extra.get("long_prefill_token_threshold", 0)),
            recompute_on_load_failure=spec.transfer.on_failure == "recompute")
        self.pool = BlockPool(num_blocks, eng.block_size)
        self.tier = host_tier(eng.host_tier_gib, self.cost, int_block_hashes())
        self.payload_bytes_per_block = {c.name: component_rows_bytes(c, spec.sim.payload_scale) for c in components}
        t = spec.transfer
        self.kv_address: str | None = None
        self.producer: ProducerSide | None = None
        self.consumer: ConsumerSide | None = None
        if role == "prefill":
            from pdcluster.proto.devices import DEVICES

            # Recording: a prefill that reads a peer's tier first paces its read as D does (consumer.py).
            kv = make_paged_kv(components, num_blocks, spec.sim.payload_scale, RecordingPagedKv)
            kv_port = spec.kv_port(role, index)
            self.kv_address = host_port(self.address.advertise, kv_port)
            self.producer = ProducerSide(self.engine_id, components, kv, eng.block_size, self.address.bind, kv_port,
                                         t.chunk_bytes, t.lease_s, t.timeout_s, t.break_transfers_with_prefix,
                                         DEVICES[spec.device].collective_backend, spec.secret(),
                                         advertise=self.address.advertise, require_seal=t.encrypt)
        else:
            self._d_kv = make_paged_kv(components, num_blocks, spec.sim.payload_scale, RecordingPagedKv)
        self.publisher = self._event_publisher()
        self.serve_requests_on(self.address, spec.secret())
        self.scheduler: Scheduler | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.started_s = time.time() - t0

    def _event_publisher(self) -> EventPublisher:
        from pdcluster.proto.kv_event_wire import engine_kv_events_config
        from pdcluster.transfer.auth import curve_keys

        cfg = engine_kv_events_config(self.spec, self.role, self.index, self.address.bind)
        return EventPublisher(cfg["endpoint"], cfg["replay_endpoint"], topic=cfg["topic"],
                              curve=curve_keys(self.spec.secret()))

    def _publish(self, events) -> None:
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def _started(self) -> Scheduler:
        """The scheduler loop, started on the actor's event loop at the first call that needs it."""
        if self.scheduler is None:
            loop = asyncio.get_running_loop()
            # D's KV comes from P; P's may come from a peer's tier first (the pool): both consume.
            kv = self.producer.kv if self.role == "prefill" else self._d_kv
            hooks = self.consumer = ConsumerSide(self.engine_id, self.cost.components, kv, self.config.block_size,
                                                 self.cost, self.spec.transfer.timeout_s, loop, self.spec.secret(),
                                                 self.spec.transfer.encrypt)
            if self.role == "prefill":
                hooks = PrefillSide(self.producer, self.consumer)
            self.scheduler = Scheduler(self.config, self.pool, self.cost, hooks, on_events=self._publish,
                                       variation=StepVariation(self.cost.params.variation, self.name), tier=self.tier)
            hooks.scheduler = self.scheduler
            self._task = loop.create_task(self.scheduler.run())
        elif self._task.done():
            raise RuntimeError(f"{self.name}: the scheduler loop ended: {self._task.exception()!r}")
        return self.scheduler

    def _request_id(self, request_id: str) -> str:
        # Unique per call: clients may reuse ids (X-Request-Id) while P still holds the last one's blocks.
        return f"{request_id}#{next(self._ids)}"

    # ------------------------------------------------------------------ EngineActor's interface

    async def info(self) -> InstanceInfo:
        import ray

        extra = {"engine": "sim", "kv_blocks": self.pool.num_blocks - 1, "payload_scale": self.spec.sim.payload_scale,
                 "payload_bytes_per_block": self.payload_bytes_per_block}
        planes = instance_planes(self.address, await self.open_channel(),
                                 self.spec.kv_event_ports(self.role, self.index))
        return InstanceInfo(name=self.name, role=self.role, index=self.index, node_ip=ray.util.get_node_ip_address(),
                            pid=os.getpid(), kv_address=self.kv_address, engine_id=self.engine_id,
                            started_s=self.started_s, extra=extra, planes=planes)

    def clock(self) -> int:
        return time.monotonic_ns()

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(kv_cache_usage=self.pool.usage, running=len(s.running) if s else 0,
                          waiting=s.num_waiting if s else 0, steps=s.steps if s else 0)

    async def health(self) -> bool:
        self._started()
        return True

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        assert self.role == "prefill", f"{self.name} got a prefill: the router mixed up P and D"
        sched = self._started()
        rid = self._request_id(req.request_id)
        transfer_id = req.transfer_id or req.request_id
        s = req.sampling
        pool = req.pool  # a peer's tier offers the prompt's first blocks: read them first
        if pool is not None and pool.num_tokens > len(req.prompt_token_ids):
            raise ValueError(f"prefill {req.request_id}: the pool's handle covers {pool.num_tokens} tokens, the "
                             f"prompt has {len(req.prompt_token_ids)}")
        with self.producer.ids_in_use.taken(transfer_id):
            if pool is not None:
                self.consumer.expect(rid, pool)
            try:
                sreq = sched.add(SimRequest(rid, list(req.prompt_token_ids), max_tokens=1, ignore_eos=s.ignore_eos,
                                            stop_token_ids=frozenset(s.stop_token_ids), retain_s=s.retain_s,
                                            external_tokens=pool.num_tokens if pool else 0))
                self.producer.produce(rid, transfer_id)
                while (delta := await sreq.out.get()).finish_reason is None:
                    pass
            except asyncio.CancelledError:
                sched.abort(rid)
                raise
            finally:
                read = self.consumer.take_report(rid)
        if delta.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"prefill {req.request_id} on {self.name} ended with {delta.finish_reason!r}")
        pool_tokens = read.transferred_tokens if read is not None and read.error is None else 0
        return PrefillResult(request_id=req.request_id, connector_params=None, prompt_tokens=sreq.num_prompt_tokens,
                             p_cached_tokens=max(0, sreq.num_cached_tokens) + pool_tokens,
                             p_tier_tokens=sreq.num_tier_tokens, p_tier_load_ns=tier_load_ns(self.tier, sreq),
                             engine=EngineTimes(sreq.queued_ns, sreq.scheduled_ns, sreq.first_token_ns),
                             p_pool_tokens=pool_tokens, p_pool=read)

    async def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeDelta]:
        assert self.role == "decode", f"{self.name} got a decode: the router mixed up P and D"
        sched = self._started()
        rid = self._request_id(req.request_id)
        handle = req.handle
        if handle is not None and handle.num_tokens > len(req.prompt_token_ids):
            raise ValueError(f"decode {req.request_id}: the handle covers {handle.num_tokens} tokens, the prompt "
                             f"has {len(req.prompt_token_ids)}")
        s = req.sampling
        sreq = SimRequest(rid, list(req.prompt_token_ids), max_tokens=s.max_tokens, ignore_eos=s.ignore_eos,
                          stop_token_ids=frozenset(s.stop_token_ids), min_tokens=s.min_tokens, retain_s=s.retain_s,
                          external_tokens=handle.num_tokens if handle else 0)
        if handle is not None:
            self.consumer.expect(rid, handle)
        try:
            sched.add(sreq)
        except ValueError:
            self.consumer.take_report(rid)
            raise
        finished = False
        held_ids: list[int] = []  # final_only: every token so far, sent with the finish
        held_ns: list[int] = []
        try:
            while True:
                delta = await sreq.out.get()
                if delta.finish_reason is None:
                    if s.final_only:
                        held_ids += delta.token_ids
                        held_ns += delta.token_ns
                    else:
                        yield DecodeDelta(new_token_ids=delta.token_ids, token_ns=delta.token_ns)
                    continue
                finished = True
                report = self.consumer.take_report(rid)
                transfer, cached = None, max(0, sreq.num_cached_tokens)
                if report is not None:
                    transfer = replace(report, kv_ready_ns=sreq.kv_ready_ns)
                    if report.error is None:
                        cached = report.d_cached_tokens + report.transferred_tokens
                yield DecodeDelta(new_token_ids=held_ids + delta.token_ids, finish_reason=delta.finish_reason,
                                  transfer=transfer, num_cached_tokens=cached,
                                  engine=EngineTimes(sreq.queued_ns, sreq.scheduled_ns, sreq.first_token_ns),
                                  token_ns=(*held_ns, *delta.token_ns))
                return
        finally:
            if not finished:  # the router cancelled the stream: the client went away
                sched.abort(rid)
                self.consumer.take_report(rid)

    async def open_pool(self, req: PoolRequest) -> PoolOffer:
        """The run of the prompt's first blocks its tier's book holds, offered from P's KV server
        (their payload made from their keys, cluster/sim/producer.py)."""
        if self.producer is None or self.tier is None:
            return PoolOffer(req.transfer_id, 0)
        sched = self._started()
        prompt = list(req.prompt_token_ids)
        hashes = sched.hash_blocks(prompt, [])
        tokens = self.tier.offer(hashes, len(prompt))
        if tokens:
            self.producer.offer_pool(req.transfer_id, hashes, prompt[:tokens], self.spec.transfer.lease_s)
        return PoolOffer(req.transfer_id, tokens)

    async def tier_counts(self) -> TierCounts | None:
        return self.tier.counts() if self.tier is not None else None

    async def reset_prefix_cache(self) -> bool:
        sched = self._started()
        done = self.pool.reset()
        if done and self.tier is not None:
            self.tier.clear()
        sched.wake()  # publishes AllBlocksCleared
        return done

    def check_blocks(self) -> dict[str, int]:
        """Tests: the pool's invariants (AssertionError names a broken one) and its counts."""
        self.pool.check_integrity()
        return {"total": self.pool.num_blocks - 1, "free": self.pool.num_free, "held": self.pool.num_held,
                "cached": self.pool.num_cached}

    def sim_stats(self) -> SimStats:
        """What only the simulated engine knows: tests and tools check the payload really moved."""
        s = self.scheduler
        return SimStats(received_bytes=self.consumer.received_bytes if self.consumer else 0,
                        payload_bytes_per_block=dict(self.payload_bytes_per_block),
                        steps=s.steps if s else 0, lag_resets=s.lag_resets if s else 0)

    def shutdown(self) -> None:
        self.close_channel()
        if self.scheduler is not None:
            self.scheduler.stop()
        for side in (self.producer, self.consumer):
            if side is not None:
                side.stop()
        self.publisher.shutdown()
