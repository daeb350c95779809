"""pdcluster's vLLM KV connector: P serves finished prefills, D pulls what it lacks.

Loaded by vLLM through `kv_connector_module_path="pdcluster.transfer.connector"`,
`kv_connector="PdcConnector"`; P runs it as `kv_producer`, D as `kv_consumer`.
vLLM makes two instances per engine: the scheduler side (in EngineCore) decides
what moves, the worker side (beside the KV tensors) moves it over gRPC.

Flow of one request (vLLM's NIXL connector does the same with RDMA reads):
1. P gets kv_transfer_params {PRODUCE_KEY: True}, prefills with max_tokens=1 (its
   prefix cache skipping what it holds). `request_finished` keeps the blocks
   (delay free), hands a lease to P's worker, and returns a TransferHandle.
2. D gets the same prompt with the handle. `get_num_new_matched_tokens` offers
   the tokens past D's own prefix hit as external, loaded asynchronously;
   `update_state_after_alloc` plans P-block -> D-block per KV-cache group.
3. D's worker pulls the planned blocks, then releases P's lease; P's worker
   reports the lease ended, and vLLM frees P's blocks. A failed pull is reported
   as failed_recving: vLLM errors the request, or recomputes it
   (kv_load_failure_policy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from pdcluster.transfer.groups import describe_groups
from pdcluster.transfer.grpc_client import KvFetcher, LoadJob, PullTiming
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.handle import PRODUCE_KEY, HandleError, TransferHandle
from pdcluster.transfer.leases import LeaseTable
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.plan import TransferPlan, blocks_for, plan_transfer

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kv_transfer_params key of D's per-request report (returned in D's final output).
D_STATS_KEY = "pdc_d_stats"


@dataclass(frozen=True)
class ConnectorSettings:
    """From kv_connector_extra_config (set by cluster/engine_actor.py)."""

    host: str = "127.0.0.1"
    port: int = 0  # P's KV server; 0: any free port
    advertise_host: str | None = None  # address D should dial; default: host
    lease_s: float = 60.0
    timeout_s: float = 30.0
    chunk_bytes: int = 1 << 20

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass(frozen=True)
class LeaseStart:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass
class PdcMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    leases: list[LeaseStart] = field(default_factory=list)  # P: blocks D may now read
    loads: list[LoadJob] = field(default_factory=list)  # D: what to pull (or only release)


@dataclass
class PullTimings(KVConnectorWorkerMetadata):
    """Worker -> scheduler: how each finished pull went (for the request's timeline)."""

    pulls: dict[str, PullTiming] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PullTimings), f"cannot merge {type(other).__name__} into PullTimings"
        return PullTimings({**self.pulls, **other.pulls})


class PdcConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self.engine_id: str = cfg.engine_id
        self.settings = ConnectorSettings.from_extra(cfg.kv_connector_extra_config or {})
        self.groups = describe_groups(kv_cache_config)
        self.null_block_id: int | None = None  # set by bind_gpu_block_pool (scheduler side)
        self.is_producer = cfg.is_kv_producer
        # Scheduler side ----------------------------------------------------
        self._pending = PdcMetadata()
        # D: requests whose handle was consumed (a plan or a release was issued).
        self._handled: set[str] = set()
        # D: request_id -> its transfer report, until request_finished returns it.
        self._d_stats: dict[str, dict] = {}
        # Worker side (set in register_kv_caches) ---------------------------
        self._worker: _Worker | None = None
        self.kv_address: str | None = None

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        handle = self._handle_of(request)
        if handle is None or request.request_id in self._handled:
            return 0, False
        count = min(handle.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        handle = self._handle_of(request)
        if handle is None or request.request_id in self._handled:
            return  # also the second call, after the load finished
        self._handled.add(request.request_id)
        if num_external_tokens == 0:
            # D's own cache covers everything P has: pull nothing, but free P's lease.
            plan = TransferPlan(tuple(), d_cached_tokens=handle.num_tokens, transferred_tokens=0)
        else:
            hit_blocks = tuple(sum(b.block_hash is not None and not b.is_null for b in g) for g in blocks.blocks)
            plan = plan_transfer(
                tuple(g.kind for g in self.groups), handle.block_ids, tuple(tuple(g) for g in blocks.get_unhashed_block_ids_all_groups()),
                hit_blocks, d_cached_tokens=handle.num_tokens - num_external_tokens, num_tokens=handle.num_tokens)
        self._pending.loads.append(LoadJob(request.request_id, handle, plan))
        self._d_stats[request.request_id] = self._report(plan)

    def _report(self, plan: TransferPlan) -> dict:
        blocks = [0] * len(self.groups)
        for g in plan.groups:
            blocks[g.group] = g.num_blocks
        return {"d_cached_tokens": plan.d_cached_tokens, "transferred_tokens": plan.transferred_tokens,
                "blocks_per_group": blocks,
                "bytes_per_group": [n * g.page_bytes for n, g in zip(blocks, self.groups)]}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        now_ns = time.monotonic_ns()
        timings = connector_output.kv_connector_worker_meta
        if isinstance(timings, PullTimings):
            for request_id, t in timings.pulls.items():
                if (report := self._d_stats.get(request_id)) is not None:
                    report.update(transfer_start_ns=t.start_ns, transfer_end_ns=t.end_ns,
                                  bytes_per_group=list(t.bytes_per_group))
        for request_id in connector_output.finished_recving or ():
            if (report := self._d_stats.get(request_id)) is not None:
                report["kv_ready_ns"] = now_ns  # the scheduler sees the KV from this step on
        # A failed pull: vLLM errors the request or recomputes it (kv_load_failure_policy);
        # either way nothing came from P, and the report says so.
        for request_id in connector_output.failed_recving or ():
            report = self._d_stats.get(request_id)
            if report is not None:
                report.update(transferred_tokens=0, d_cached_tokens=0, error="KV pull from P failed",
                              blocks_per_group=[0] * len(self.groups))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending = self._pending, PdcMetadata()
        return meta

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.null_block_id = gpu_block_pool.null_block.block_id

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this one when the hybrid KV cache manager is off (one group).
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if self.is_producer and params.get(PRODUCE_KEY):
            return self._finish_prefill(request, tuple(tuple(g) for g in block_ids))
        handle = self._handle_of(request)
        if handle is None:
            return False, None
        if request.request_id not in self._handled:
            # Aborted before D allocated blocks: nothing to pull, but P must not wait for its lease.
            self._handled.add(request.request_id)
            self._pending.loads.append(LoadJob(request.request_id, handle, TransferPlan((), 0, 0)))
        self._handled.discard(request.request_id)
        return False, {D_STATS_KEY: self._d_stats.pop(request.request_id, None)}

    def _finish_prefill(self, request: Request, block_ids: tuple[tuple[int, ...], ...]):
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or errored: nothing for D
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        held = []
        for group, ids in zip(self.groups, block_ids):
            ids = ids[:blocks_for(num_tokens, group.block_size)]
            if group.window_blocks:
                # P freed the out-of-window blocks (now null): only the window's tail is held.
                ids = tuple(b for b in ids[-group.window_blocks:] if b != self.null_block_id)
            held.append(tuple(ids))
        held = tuple(held)
        self._pending.leases.append(LeaseStart(request.request_id, held))
        handle = TransferHandle(engine_id=self.engine_id, address=self._advertised_address(),
                                request_id=request.request_id, block_ids=held, num_tokens=num_tokens)
        return True, handle.to_params()

    def _advertised_address(self) -> str:
        s = self.settings
        assert s.port, "P's KV server port must be fixed in the config: the scheduler cannot ask the worker"
        return f"{s.advertise_host or s.host}:{s.port}"

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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None, "start_load_kv before register_kv_caches"
        self._worker.start(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.results()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.take_timings()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the request is scheduled (async pull)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # P serves straight from its paged cache; nothing to save

    def wait_for_save(self):
        return

    def shutdown(self):
        if self._worker is not None:
            self._worker.stop()


class _Worker:
    """Worker-side state: the KV server on P, the fetcher on D."""

    def __init__(self, conn: PdcConnector, kv_caches: dict[str, torch.Tensor]):
        cfg = conn._kv_cache_config
        groups = {name: i for i, g in enumerate(cfg.kv_cache_groups) for name in g.layer_names}
        self.kv = PagedKv(kv_caches, groups, cfg.num_blocks)
        self.settings = conn.settings
        self.leases = LeaseTable()
        self._timings: dict[str, PullTiming] = {}  # pulls finished since the last step's metadata
        self.server = self.fetcher = None
        if conn.is_producer:
            s = conn.settings
            self.server = KvServer(conn.engine_id, self.kv, self.leases, s.host, s.port, s.chunk_bytes)
        else:
            self.fetcher = KvFetcher(conn.engine_id, self.kv, conn.settings.timeout_s)

    def start(self, meta: PdcMetadata) -> None:
        for lease in meta.leases:
            self.leases.add(lease.request_id, lease.block_ids, self.settings.lease_s)
        for job in meta.loads:
            assert self.fetcher is not None, "a load job reached a producer: kv_role misconfigured"
            self.fetcher.submit(job)

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults(finished_sending=self.leases.take_finished())
        if self.fetcher is not None:
            r = self.fetcher.take_results()
            out.finished_recving, out.failed_recving = r.finished, r.failed
            self._timings.update(r.timings)
        return out

    def take_timings(self) -> PullTimings | None:
        if not self._timings:
            return None
        out, self._timings = PullTimings(self._timings), {}
        return out

    def stop(self) -> None:
        for part in (self.server, self.fetcher):
            if part is not None:
                part.stop()

