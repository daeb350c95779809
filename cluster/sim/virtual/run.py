"""`simulate`: one cluster spec, one load, on the virtual clock, in one call.

    run = simulate(load_spec("deploy/p8d8-sim.yaml"), BenchConfig.from_preset("c90"))
    run.summaries["formal"]            # cluster/replay/metrics.py's PhaseSummary, as `pdc bench run` reports
    run.records                        # router/timeline.py's RequestRecords, as a run directory holds
    write_virtual_run(run, out_dir)    # both on disk: `pdc timeline summary OUT/timeline` reads it

The spec is a simulated cluster's (`engine: sim` and its `sim:` section), or a vLLM one
with a parameter file given (`params=`): the same engine args, the cost model instead of
the model. The load is `pdc bench run`'s (cluster/replay/run.py build_workload), or requests given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.replay import workloads
from pdcluster.cluster.replay.metrics import PhaseSummary, summarize_phases
from pdcluster.cluster.replay.outputs import write_run
from pdcluster.cluster.replay.records import BenchRequest, RequestResult
from pdcluster.cluster.replay.run import BenchConfig, build_workload, expected_after_failures
from pdcluster.cluster.sim.block_pool import BlockPool
from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.cluster.sim.scheduler_config import SchedulerConfig
from pdcluster.cluster.sim.tier import host_tier
from pdcluster.cluster.sim.variation import StepVariation
from pdcluster.cluster.sim.virtual.agreement import served
from pdcluster.cluster.sim.virtual.client import VirtualClient
from pdcluster.cluster.sim.virtual.events import EventLoop
from pdcluster.cluster.sim.virtual.instance import VirtualInstance, VirtualScheduler
from pdcluster.cluster.sim.virtual.kv import VirtualKv
from pdcluster.cluster.sim.virtual.prompts import PromptCache
from pdcluster.cluster.sim.virtual.router import VirtualRouter
from pdcluster.cluster.sim.vocab import spec_vocab
from pdcluster.proto.spec import ClusterSpec, SimSpec, SpecError, resolve_sim_params
from pdcluster.router.run_store import InstanceMeta, RunMeta, RunStore, versions
from pdcluster.router.timeline import ClockOffset, RequestRecord


@dataclass(frozen=True)
class InstanceStats:
    name: str
    role: str
    requests: int  # requests it served (P: prefills; D: decodes, local prefills included)
    steps: int
    step_events: int  # events its steps took (a run of repeated decode steps is one)
    busy_s: float  # virtual time in steps
    preemptions: int = 0  # running requests put back for lack of KV blocks
    evictions: int = 0  # cached blocks reused


@dataclass
class VirtualRun:
    spec: ClusterSpec
    config: BenchConfig
    requests: list[BenchRequest]
    results: list[RequestResult]
    records: list[RequestRecord]
    summaries: dict[str, PhaseSummary]
    hit_mismatches: list[str]
    instances: list[InstanceStats]
    virtual_s: float  # the load's length on the virtual clock
    wall_s: float  # what simulating it took (the load built, not counted)
    events: int

    @property
    def speedup(self) -> float:
        return self.virtual_s / self.wall_s if self.wall_s > 0 else math.inf


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector off for a run. A C90 allocates millions of short-lived
    objects (blocks, events, lists), freed by reference counting; each allocation burst set off
    a collection that scanned every live object, the pools' blocks and the load's prompts
    included: ~500 collections, ~1 s of a 4-5 s run. What a run leaves in cycles is collected
    once it is over."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def as_sim_spec(spec: ClusterSpec, params: str | None) -> ClusterSpec:
    """The spec with its cost model: a simulated spec as it is (its params replaced if given),
    a vLLM spec turned into its simulated twin (SpecError if no params for it)."""
    if params is not None:
        sim = (spec.sim or SimSpec(params=params)).model_copy(update={"params": resolve_sim_params(params, str)})
    elif spec.sim is not None:
        sim = spec.sim
    else:
        raise SpecError(f"spec {spec.name!r} runs vLLM engines: give a parameter file for its simulated twin "
                        f"(--params, e.g. a `pdc sim fit` output)")
    engine = spec.engine.model_copy(update={"kind": "sim"})
    roles = {r: getattr(spec, r).model_copy(update={"engine": getattr(spec, r).engine.model_copy(
        update={"kind": None})}) for r in ("prefill", "decode")}
    return spec.model_copy(update={"sim": sim, "engine": engine, **roles})


def simulate(spec: ClusterSpec, cfg: BenchConfig, requests: list[BenchRequest] | None = None, *,
             params: str | None = None, prompts: PromptCache | None = None, repeat_steps: bool = True,
             vocab_size: int | None = None, on_phase: Callable[[str, int], None] | None = None) -> VirtualRun:
    """Run the load on the cluster on the virtual clock. `prompts`: a cache shared by several runs
    of the same load (`pdc plan`); `repeat_steps`: run repeatable decode steps as one event
    (the same outcome; off to check that it is)."""
    spec = as_sim_spec(spec, params)
    vocab, eos = spec_vocab(spec) if vocab_size is None else (vocab_size, None)
    if requests is None:
        requests = build_workload(cfg, cfg.vocab_size or vocab)
    block_size = spec.role_engine("prefill").block_size
    if cfg.engine_block_size != block_size:
        raise ValueError(f"the load's engine_block_size ({cfg.engine_block_size}) is not the spec's block_size "
                         f"({block_size}): its expected hits would be another cache's")
    prompts = prompts or PromptCache(block_size)
    loop = EventLoop()
    cost = CostModel(SimParams.load(spec.sim.params), block_size, spec.sim.devices_per_instance)
    instances: dict[str, VirtualInstance] = {}
    kv = VirtualKv(loop, cost, spec.transfer.lease_s, release=lambda p, ids: instances[p].release(ids),
                   load_ended=lambda d, rid, err: instances[d].load_ended(rid, err))
    router_hooks: dict[str, Callable] = {}
    prefill, decode = [], []
    for role, out in (("prefill", prefill), ("decode", decode)):
        eng = spec.role_engine(role)
        config = SchedulerConfig(
            block_size=eng.block_size, max_num_batched_tokens=eng.max_num_batched_tokens,
            max_num_seqs=eng.max_num_seqs, max_model_len=eng.max_model_len, vocab_size=vocab, eos_token_id=eos,
            long_prefill_token_threshold=int(eng.extra.get("long_prefill_token_threshold", 0)),
            delta_interval_s=math.inf,  # the first token and the finish; every token keeps its time
            recompute_on_load_failure=spec.transfer.on_failure == "recompute")
        num_blocks = (spec.sim.kv_blocks_of(role) or cost.kv_capacity_blocks()) + 1  # + vLLM's null block
        for i in range(getattr(spec, role).instances):
            name = f"{role}-{i}"
            hooks = kv.producer() if role == "prefill" else kv.consumer()
            pool = BlockPool(num_blocks, eng.block_size, int_hashes=False)  # its events: the router's hashes
            core = VirtualScheduler(config, pool, cost, hooks,
                                    lambda events, name=name: router_hooks[name](events), loop,
                                    StepVariation(cost.params.variation, name),
                                    host_tier(eng.host_tier_gib, cost, int_hashes=False))
            inst = VirtualInstance(name, role, len(instances), loop, core, repeat_steps)
            instances[name] = inst
            out.append(inst)
    router = VirtualRouter(spec, loop, prefill, decode, kv)
    for name in instances:
        router_hooks[name] = router.kv_events(name)
    client = VirtualClient(loop, router, prompts, cfg, on_phase)
    t0 = time.perf_counter()
    with _no_cycle_collection():
        client.start(requests)
        loop.run()
    wall = time.perf_counter() - t0
    assert len(client.results) <= len(requests), "more results than requests: a request ended twice"
    by_index = {(r.phase, r.index): r for r in requests}
    results = expected_after_failures(client.results, {r.index: by_index[(r.phase, r.index)] for r in client.results},
                                      block_size)
    mismatches = workloads.check_hits((by_index[(r.phase, r.index)], r.cached_tokens) for r in results
                                      if r.ok and r.phase in ("check", "formal"))
    counts = served(client.records)
    stats = [InstanceStats(i.name, i.role, counts.get(i.name, 0), i.core.steps, i.events, i.busy_ns / 1e9,
                           i.core.preemptions, i.core.pool.evictions) for i in instances.values()]
    return VirtualRun(spec, cfg, requests, results, client.records, summarize_phases(results, cfg.max_concurrency),
                      mismatches, stats, (loop.now_ns - loop.origin_ns) / 1e9, wall, loop.events)


def write_virtual_run(run: VirtualRun, out_dir: str | Path) -> Path:
    """OUT/timeline: a run directory (meta.json, requests.jsonl) for `pdc timeline`; OUT itself:
    `pdc bench run`'s files (summary.json, summary.csv, requests.jsonl), timelines joined. A run
    written to OUT before is replaced whole (the store appends: its records would stay in front)."""
    out = Path(out_dir)
    shutil.rmtree(out / "timeline", ignore_errors=True)
    meta = RunMeta(run_id=f"{run.spec.name}-virtual", started_wall_ns=time.time_ns(), started_mono_ns=0,
                   spec=json.loads(run.spec.model_dump_json()), versions=versions(),
                   instances=[InstanceMeta(i.name, i.role, "virtual", 0, ClockOffset(0, 0)) for i in run.instances])
    store = RunStore(out / "timeline", meta)
    for rec in run.records:
        store.append(rec)
    store.close()
    config = {**dataclasses.asdict(run.config), "virtual_clock": True, "virtual_s": run.virtual_s,
              "wall_s": run.wall_s, "timeline_run_dir": str(out / "timeline"), "hit_mismatches": run.hit_mismatches}
    write_run(out, run.results, run.summaries.values(), config, {r.request_id: r for r in run.records})
    return out
