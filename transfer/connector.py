"""pdcluster's vLLM KV connector: P streams each prefill's KV to D as it is computed.

Loaded by vLLM through `kv_connector_module_path="pdcluster.transfer.connector"`,
`kv_connector="PdcConnector"`; P runs it as `kv_producer`, D as `kv_consumer`.
vLLM makes two instances per engine: the scheduler side (in EngineCore) decides
what moves, the worker side (beside the KV tensors) moves it over gRPC.

Flow of one request. The router names the transfer (transfer_id) and sends:
1. P the prompt with kv_transfer_params {PRODUCE_KEY: transfer_id}, max_tokens=1.
   Every step that runs it, P's scheduler side passes its worker the request's
   block table and how far the step computes it; the worker's source table
   (transfer/sources.py) marks each layer ready as the forward pass writes it
   (`save_kv_layer`). When the prefill ends, `request_finished` keeps the blocks
   (delay free) under a lease.
2. D the same prompt with the TransferHandle the router built (P's engine id and KV
   address, transfer_id, prompt length, transport). `get_num_new_matched_tokens` offers the tokens past D's own prefix
   hit as external, loaded asynchronously; `update_state_after_alloc` plans, per
   KV-cache group, which block indices of P's table go into which of D's blocks.
3. D's worker asks P's KV server for those blocks; P streams each layer's blocks
   as soon as they are ready, then D releases P's source. P's worker reports
   the source ended, and vLLM frees P's blocks. A failed load is reported as
   failed_recving: vLLM errors the request, or recomputes it
   (kv_load_failure_policy).

D's side of steps 2 and 3 (the plan, the pull followed to its end, the report) is
transfer/connector_loads.py.

Push or pull is only the order in which the router sends: D's request at the same
time as P's (push: the transfer runs under P's forward pass, layer by layer), or
after P answered (pull).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pdcluster.proto.handle import HandleError, TransferHandle, transfer_id_of
from pdcluster.proto.messages import TransferStats
from pdcluster.transfer import vllm_compat
from pdcluster.transfer.groups import describe_groups
from pdcluster.transfer.plan import NULL_BLOCK_ID
from pdcluster.transfer.tier_scheduler import TierScheduler
from pdcluster.transfer.vllm_compat import (  # vLLM's, through the module that knows each version
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    RequestStatus,
    SupportsHMA,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

from pdcluster.transfer.connector_loads import Loads
from pdcluster.transfer.connector_meta import ConnectorSettings, PdcMetadata, PullTimings, SourceEnd, SourceStep
from pdcluster.transfer.connector_worker import _Worker

log = logging.getLogger(__name__)

# kv_transfer_params key of D's per-request report (TransferStats.to_params, in D's final output).
D_STATS_KEY = "pdc_d_stats"
# kv_transfer_params keys of P's host-tier hit: of the prompt tokens P did not compute, those it
# loaded from its host tier; and those vLLM counted as cached but computed, their load (from its
# tier, or a peer's) having failed (in P's final output; absent: none).
P_TIER_KEY = "pdc_p_tier_tokens"
P_TIER_FAILED_KEY = "pdc_p_tier_failed_tokens"
# kv_transfer_params key of P's read of a peer's host tier (the pool): its TransferStats.to_params.
P_POOL_KEY = "pdc_p_pool"


class PdcConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self.engine_id: str = cfg.engine_id
        self.settings = ConnectorSettings.from_extra(cfg.kv_connector_extra_config or {})
        self.groups = describe_groups(kv_cache_config)
        self.is_producer = cfg.is_kv_producer
        self.api = vllm_compat.check_supported()
        if len(self.groups) > 1 and not self.api.reports_failed_multi_group_loads:
            raise vllm_compat.UnsupportedVllm(
                f"vLLM {self.api.version} cannot end a request whose KV load failed in a model with "
                f"{len(self.groups)} KV-cache groups (its scheduler maps failed blocks back for one group): "
                f"use vLLM 0.32 or later for hybrid models")
        # P on vLLM < 0.32: block tables rebuilt from the scheduled requests (no block state).
        self._tables = None if self.api.block_state else vllm_compat.BlockTables()
        # Scheduler side ----------------------------------------------------
        self._pending = PdcMetadata()
        # The instance's host tier (transfer/tier_scheduler.py), when the spec gives it bytes.
        self._tier = TierScheduler(self.groups, self.settings.host_tier_bytes) if self.settings.host_tier_bytes else None
        # P: request_id -> (transfer_id, request) for requests producing for D, from
        # their first schedule (update_state_after_alloc) until request_finished.
        self._producing: dict[str, tuple[str, Request]] = {}
        # P: the subset that some step has run (its worker knows the source).
        self._ran: set[str] = set()
        # D: the requests with a handle, their loads and reports (transfer/connector_loads.py).
        self._loads = Loads(self.groups, self._tier, self.api.failed_recving)
        # Worker side (set in register_kv_caches) ---------------------------
        self._worker: _Worker | None = None
        self.kv_address: str | None = None

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        # D: where P's KV is. P: a peer's host tier offering the prompt's first blocks (the pool).
        handle = self._handle_of(request)
        if handle is None:  # P, or D prefilling itself: what its host tier holds past the device's hit
            return (self._tier.lookup(request, num_computed_tokens), False) if self._tier is not None else (0, False)
        return self._loads.matched(request, handle, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if self.is_producer and (transfer_id := transfer_id_of(request.kv_transfer_params)) is not None:
            self._producing[request.request_id] = (transfer_id, request)
        if self._tier is not None:
            self._tier.track(request)
        handle = self._handle_of(request)
        if handle is None:  # P, or D prefilling itself: its tier's hit is loaded in the step
            if self._tier is not None:
                self._tier.allocated(request, blocks.get_block_ids(), num_external_tokens)
            return
        self._loads.allocated(request, handle, blocks, num_external_tokens, self._pending)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        timings = connector_output.kv_connector_worker_meta
        if self._tier is not None and isinstance(timings, PullTimings):
            self._tier.lost(timings.tier_lost)
            for request_id in timings.tier_failed:
                self._tier.load_failed(request_id)
        self._loads.update(connector_output)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._tables is not None and (self.is_producer or self._tier is not None):
            self._tables.update(scheduler_output)
        if self._producing:
            self._add_source_steps(scheduler_output)
        if self._tier is not None:
            self._tier.written(time.monotonic())
            state = scheduler_output.kv_connector_block_state if self._tables is None else self._tables
            for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
                if self._tier.prefilling(request_id) and (ids := state.get_block_ids(request_id)) is not None:
                    self._tier.stepped(request_id, num_scheduled, ids)
            self._pending.tier = self._tier.take_orders()
        meta, self._pending = self._pending, PdcMetadata()
        return meta

    def _add_source_steps(self, out: SchedulerOutput) -> None:
        """P: tell the worker how far this step computes each producing request, and in which blocks.
        Called before vLLM advances num_computed_tokens for the step."""
        state = out.kv_connector_block_state if self._tables is None else self._tables
        assert state is not None, "vLLM gave the connector no block state: P cannot stream its KV"
        for request_id in out.preempted_req_ids or ():
            if request_id in self._ran:
                self._pending.preempted.append(request_id)
        for request_id, num_scheduled in out.num_scheduled_tokens.items():
            entry = self._producing.get(request_id)
            if entry is None:
                continue
            transfer_id, request = entry
            self._ran.add(request_id)
            self._pending.steps.append(SourceStep(
                transfer_id, request_id, request.num_prompt_tokens,
                tuple(tuple(g) for g in state.get_block_ids(request_id)),
                min(request.num_computed_tokens + num_scheduled, request.num_prompt_tokens)))

    def take_events(self):
        # What the host tier stored and evicted, published by vLLM beside its device cache's events.
        if self._tier is None:
            return ()
        from pdcluster.proto import kv_event_wire as wire
        from pdcluster.transfer.vllm_compat import BlockRemoved, BlockStored, maybe_convert_block_hash

        out = []
        for ev in self._tier.take_events():
            hashes = [maybe_convert_block_hash(h) for h in ev.block_hashes]
            if isinstance(ev, wire.BlockRemoved):
                out.append(BlockRemoved(block_hashes=hashes, medium=ev.medium, group_idx=ev.group_idx))
            else:
                parent = None if ev.parent_block_hash is None else maybe_convert_block_hash(ev.parent_block_hash)
                out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(ev.token_ids),
                                       block_size=ev.block_size, lora_id=None, medium=ev.medium, lora_name=None,
                                       group_idx=ev.group_idx))
        return out

    def reset_cache(self) -> bool:
        # vLLM's reset_prefix_cache(reset_connector=True): the host tier empties with the device cache.
        return self._tier.reset() if self._tier is not None else True

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        assert gpu_block_pool.null_block.block_id == NULL_BLOCK_ID, (
            f"vLLM's null block is {gpu_block_pool.null_block.block_id}, not {NULL_BLOCK_ID}: update transfer/plan.py")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this one when the hybrid KV cache manager is off (one group).
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self._tables is not None:  # (vLLM < 0.32: the block table rebuilt for P and for a tier)
            self._tables.forget(request.request_id)
        handle = self._handle_of(request)
        load, failed = self._loads.ended(request, handle, self._pending) if handle is not None else (None, 0)
        if self.is_producer:
            return self._finish_prefill(request, block_ids, load, failed)
        # D keeps what it prefilled itself in its tier as it keeps what it pulled (as the simulated
        # engine does); only a request with a handle has a report.
        keep = self._keep_in_tier(request, block_ids, free_after=True)
        return keep, ({D_STATS_KEY: load.to_params() if load is not None else None} if handle is not None else None)

    def _keep_in_tier(self, request: Request, block_ids: tuple[list[int], ...], free_after: bool) -> bool:
        """A request ended: its prompt blocks go to the instance's tier, if it has one, before vLLM
        frees them. True: vLLM must wait for the worker to say they are stored."""
        if self._tier is None:
            return False
        if request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return self._tier.finished(request, block_ids, time.monotonic(), free_after=free_after)
        self._tier.forget(request.request_id)  # aborted: its KV may be partial (steps, or a pull, in flight)
        return False

    def _finish_prefill(self, request: Request, block_ids: tuple[list[int], ...], load: TransferStats | None,
                        failed: int) -> tuple[bool, dict[str, Any] | None]:
        """P's prefill ended: its source ends (its blocks kept while D reads them) and its tier
        keeps them. P's report of what it loaded rather than computed: its tier's hit, a peer's
        tier's read (`load`), and the tokens of a failed load, which it computed."""
        rid = request.request_id
        delay = self._end_source(request)
        report: dict[str, Any] = {P_POOL_KEY: load.to_params() if load is not None else None}
        if self._tier is not None:  # (its counts before the request is handed to it, which forgets them)
            report[P_TIER_KEY] = self._tier.hit_tokens.get(rid, 0)
            failed += self._tier.failed_tokens.get(rid, 0)
            # Held by the transfer's lease, its blocks are stored before it ends; else vLLM waits for them.
            delay |= self._keep_in_tier(request, block_ids, free_after=not delay)
        report[P_TIER_FAILED_KEY] = failed
        return delay, ({k: v for k, v in report.items() if v} or None)

    def _end_source(self, request: Request) -> bool:
        """True: vLLM keeps the request's blocks until the worker says D is done with them."""
        entry = self._producing.pop(request.request_id, None)
        if entry is None:
            return False
        transfer_id = entry[0]
        if request.request_id not in self._ran:
            return False  # never ran: no worker state, nothing for D
        self._ran.discard(request.request_id)
        done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        # Keep the blocks either way: a D may be reading them right now. An aborted
        # source ends as soon as its readers stop.
        self._pending.ends.append(SourceEnd(transfer_id, aborted=not done))
        return True

    @staticmethod
    def _handle_of(request: Request) -> TransferHandle | None:
        try:
            return TransferHandle.from_params(request.kv_transfer_params)
        except HandleError as err:
            log.error("request %s: %s; serving it without transfer", request.request_id, err)
            return None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker = _Worker(self, kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward pass: the sources must know this step's blocks before
        # save_kv_layer marks layers ready (start_load_kv runs after the forward).
        if self._worker is not None:
            assert isinstance(connector_metadata, PdcMetadata)
            self._worker.start(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # loads start in bind_connector_metadata

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """What vLLM < 0.32 asks instead of get_transfer_results (vllm_compat); a failed load's
        blocks go to get_block_ids_with_load_errors, the old way to fail or recompute it."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_error_blocks() if self._worker is not None else set()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return False  # vLLM >= 0.33 asks: after sleep the KV views P serves from would be stale

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.take_timings()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the request is scheduled (async pull)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        # P serves straight from its paged cache: only say this layer's KV is written.
        if self._worker is not None and self._worker.sources is not None:
            self._worker.sources.layer_done(layer_name)

    def wait_for_save(self):
        if self._worker is not None and self._worker.sources is not None:
            self._worker.sources.step_done()

    def shutdown(self):
        if self._worker is not None:
            self._worker.stop()
