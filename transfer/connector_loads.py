"""The connector's loads, scheduler side: requests that carry a TransferHandle (transfer/connector.py).

D's request carries the handle the router built for P's KV; P's may carry one for a run of the
prompt's first blocks in a peer P's host tier (the pool), which P loads as D loads P's KV and
then computes on from. D (or P) offers the tokens past its own hit
as external, loaded asynchronously (`matched`), plans per KV-cache group which of P's blocks go
into which of its own once vLLM allocated them (`allocated`), follows the worker's pull to its end
(`update`) and hands the request's report back when it ends (`ended`). With a host tier, the first
blocks past D's hit come from the tier and the rest from P.

Invariants:
- A request is in `_handled` from its plan (or release) being issued until it ends: vLLM asks again
  after the load finished, and must then get nothing new.
- A request is in `_loading` while its pull is planned and not yet reported back.
- `reports` holds each request's report from its plan until `ended` returns it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import TransferStats
from pdcluster.transfer.connector_meta import PdcMetadata, PullTimings
from pdcluster.transfer.groups import GroupInfo
from pdcluster.transfer.grpc_client import LoadJob
from pdcluster.transfer.plan import TransferPlan, plan_transfer
from pdcluster.transfer.tier_scheduler import TierScheduler

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

FAILED_PULL = "KV pull from P failed"  # the report's error, followed by why when D's worker said


def failed_pull(why: str | None) -> str:
    return f"{FAILED_PULL}: {why}" if why else FAILED_PULL


class Loads:
    def __init__(self, groups: Sequence[GroupInfo], tier: TierScheduler | None, failed_recving: bool):
        self.groups = tuple(groups)
        self.tier = tier
        self.failed_recving = failed_recving  # vLLM reports failed loads (>= 0.32)
        self._handled: set[str] = set()
        self._loading: set[str] = set()
        self.reports: dict[str, TransferStats] = {}
        # Requests whose load failed, with the tokens it was to bring: vLLM counted them as cached
        # when it scheduled the request, and then computed them (or ended the request).
        self._failed_tokens: dict[str, int] = {}

    def matched(self, request: Request, handle: TransferHandle, num_computed_tokens: int) -> tuple[int, bool]:
        """get_num_new_matched_tokens for a request with a handle."""
        if request.request_id in self._handled:
            return 0, False
        end = min(handle.num_tokens, request.num_prompt_tokens)
        if self.tier is not None:  # D's tier part of it is loaded with the pull (`allocated`)
            self.tier.lookup(request, num_computed_tokens, computed_to=end)
        count = end - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def allocated(self, request: Request, handle: TransferHandle, blocks: KVCacheBlocks, num_external_tokens: int,
                  pending: PdcMetadata) -> None:
        """update_state_after_alloc for a request with a handle: its load job, into `pending`."""
        if request.request_id in self._handled:
            return  # also the second call, after the load finished
        self._handled.add(request.request_id)
        tier_tokens = 0
        if num_external_tokens == 0:
            # D's own cache covers everything P has: pull nothing, but free P's lease.
            plan = TransferPlan((), d_cached_tokens=handle.num_tokens, transferred_tokens=0)
        else:
            hit_blocks = tuple(sum(b.block_hash is not None and not b.is_null for b in g) for g in blocks.blocks)
            end = 0  # D's tokens from this one on come from P
            if self.tier is not None:  # the first blocks past D's hit from its tier, the rest from P
                tier_tokens = self.tier.lookup_taken(request)
                end = self.tier.allocated(request, blocks.get_block_ids(), tier_tokens)
                hit_blocks = tuple(h + tier_tokens // g.block_size for h, g in zip(hit_blocks, self.groups))
            # (a window group's blocks past the tier's: the window's tail, ending at the prompt's end)
            new = tuple(tuple(b.block_id for b in g[end // info.block_size:] if b.block_hash is None and not b.is_null)
                        for g, info in zip(blocks.blocks, self.groups))
            plan = plan_transfer(self.groups, new, hit_blocks,
                                 d_cached_tokens=handle.num_tokens - num_external_tokens + tier_tokens,
                                 num_tokens=handle.num_tokens)
            self._loading.add(request.request_id)
        pending.loads.append(LoadJob(request.request_id, handle, plan))
        self.reports[request.request_id] = replace(self._report(plan), d_tier_tokens=tier_tokens)

    def _report(self, plan: TransferPlan) -> TransferStats:
        blocks = [0] * len(self.groups)
        for g in plan.groups:
            blocks[g.group] = g.num_blocks
        return TransferStats.planned(plan.d_cached_tokens, plan.transferred_tokens, tuple(blocks),
                                     tuple(g.page_bytes for g in self.groups),
                                     group_names=tuple(g.name for g in self.groups))

    def update(self, connector_output: KVConnectorOutput) -> None:
        """What the worker reported this step: the pulls' timings, the tier loads' spans, which
        loads finished or failed."""
        now_ns = time.monotonic_ns()
        timings = connector_output.kv_connector_worker_meta
        pulls = timings.pulls if isinstance(timings, PullTimings) else {}
        if self.tier is not None and isinstance(timings, PullTimings):
            for request_id, (start_ns, end_ns) in timings.tier_loads.items():
                if (report := self.reports.get(request_id)) is not None:
                    self.reports[request_id] = replace(report, d_tier_load_start_ns=start_ns, d_tier_loaded_ns=end_ns)
        for request_id, t in pulls.items():
            if (report := self.reports.get(request_id)) is not None:
                report = report.pulled(t.start_ns, t.end_ns, t.bytes_per_group)
                if report.error is not None and t.error:  # reported failed at an earlier step: now why
                    report = replace(report, error=failed_pull(t.error))
                self.reports[request_id] = report
        for request_id in connector_output.finished_recving or ():
            self._loading.discard(request_id)
            if (report := self.reports.get(request_id)) is not None:  # the scheduler sees the KV from this step on
                self.reports[request_id] = replace(report, kv_ready_ns=now_ns)
        # A failed pull: vLLM errors the request or recomputes it (kv_load_failure_policy);
        # either way nothing came from P, and the report says so.
        # (vLLM < 0.32 has no failed_recving: there the report keeps what was planned.)
        for request_id in (connector_output.failed_recving if self.failed_recving else None) or ():
            if (report := self.reports.get(request_id)) is not None:
                why = pulls[request_id].error if request_id in pulls else None
                self.reports[request_id] = report.failed(failed_pull(why))
                self._failed_tokens[request_id] = report.transferred_tokens

    def ended(self, request: Request, handle: TransferHandle, pending: PdcMetadata) -> tuple[TransferStats | None, int]:
        """The request ended: stop its load if it is running (or free P's lease if it never
        started). Its report, and the tokens of a failed load (computed, though vLLM counted them
        as cached)."""
        if request.request_id not in self._handled:
            # Aborted before D allocated blocks: nothing to receive, but P must not wait for its lease.
            self._handled.add(request.request_id)
            pending.loads.append(LoadJob(request.request_id, handle, TransferPlan((), 0, 0)))
        elif request.request_id in self._loading:
            # Aborted while its KV is arriving: stop the load (vLLM keeps the blocks until it reports).
            pending.cancels.append(request.request_id)
        self._handled.discard(request.request_id)
        return self.reports.pop(request.request_id, None), self._failed_tokens.pop(request.request_id, 0)
