"""The connector's worker side (transfer/connector.py): beside an engine's KV tensors, P's source
table and KV server, or D's fetcher; it runs what the scheduler side orders each step and reports
what finished."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdcluster.transfer.connector_meta import PdcMetadata, PullTimings
from pdcluster.transfer.grpc_client import KvFetcher, PullTiming
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.host_tier import HostTier
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.sources import SourceTable
from pdcluster.transfer.tier_load_times import LoadTimes
from pdcluster.transfer.vllm_compat import (  # vLLM's, through the module that knows each version
    KVConnectorTransferResults,
)

if TYPE_CHECKING:
    import torch

    from pdcluster.transfer.connector import PdcConnector
    from pdcluster.transfer.tier_book import BlockKey
    from pdcluster.transfer.tier_scheduler import TierOrders

log = logging.getLogger(__name__)


def _cluster_secret() -> str:
    """The cluster secret, from the env the engine actor set before vLLM started this worker:
    kept out of kv_connector_extra_config, which vLLM logs with the rest of its config."""
    import os

    from pdcluster.transfer.auth import SECRET_ENV

    secret = os.environ.get(SECRET_ENV)
    assert secret, f"{SECRET_ENV} is not set in this vLLM worker: the engine actor sets it before the engine starts"
    return secret


def kv_caches_on_accelerator(kv_caches: dict) -> bool:
    first = next(iter(kv_caches.values()))
    return (first[0] if isinstance(first, tuple) else first).device.type != "cpu"


class _Worker:
    """Worker-side state: the source table and KV server on P, the fetcher on D (and on P, for
    reads of a peer's host tier)."""

    def __init__(self, conn: PdcConnector, kv_caches: dict[str, torch.Tensor]):
        cfg = conn._kv_cache_config
        groups = {name: i for i, g in enumerate(cfg.kv_cache_groups) for name in g.layer_names}
        self.kv = PagedKv(kv_caches, groups, cfg.num_blocks)
        self.settings = conn.settings
        self._timings: dict[str, PullTiming] = {}  # loads finished since the last step's metadata
        # D on vLLM < 0.32: each load's blocks until it ends, and those of failed loads until
        # vLLM asks (get_block_ids_with_load_errors): its only word for a failed load.
        self._failed_as_blocks = not conn.api.transfer_results
        self._load_blocks: dict[str, set[int]] = {}
        self._error_blocks: set[int] = set()
        self.sources: SourceTable | None = None
        self.server = None
        self.kv_groups = tuple(g.shape for g in conn.groups)  # what a pooled run holds of each
        s = conn.settings
        # The host tier's bytes (the scheduler side's book decides); CPU engines' cache is host memory already.
        self.tier = HostTier(self.kv, pin=kv_caches_on_accelerator(kv_caches)) if s.host_tier_bytes else None
        self._tier_lost: list[BlockKey] = []
        self._tier_failed: list[str] = []  # requests whose tier load failed, since the last report
        self._tier_freed: set[str] = set()  # requests whose blocks vLLM may free now that they are stored
        self._tier_loads: dict[str, tuple[int, int]] = {}  # D: request -> its tier load's (start, end), since the last report
        # P: each prefill's tier load time, for its engine actor (transfer/tier_load_times.py).
        self.load_times = LoadTimes() if self.tier is not None and conn.is_producer else None
        secret = _cluster_secret()
        if conn.is_producer:
            self.sources = SourceTable(groups, tuple(g.block_size for g in conn.groups))
            self.server = KvServer(conn.engine_id, self.kv, self.sources, s.host, s.port, s.chunk_bytes,
                                   secret=secret, wait_s=s.timeout_s, break_prefix=s.break_prefix,
                                   channel_backend=s.channel_backend, advertise=s.advertise_host,
                                   require_seal=s.encrypt)
        # D pulls P's KV; P may read a prompt's first blocks from a peer's host tier (the pool).
        self.fetcher = KvFetcher(conn.engine_id, self.kv, s.timeout_s, secret=secret, seal=s.encrypt)

    def start(self, meta: PdcMetadata) -> None:
        if meta.tier is not None:  # first: a load fills blocks this step's sources then serve
            self._run_tier(meta.tier, {step.request_id: step.transfer_id for step in meta.steps})
        if self.sources is not None:
            for request_id in meta.preempted:
                self.sources.preempted(request_id)
            for step in meta.steps:
                self.sources.step(step.transfer_id, step.request_id, step.num_tokens, step.block_ids,
                                  step.step_tokens)
            for end in meta.ends:
                self.sources.finish(end.transfer_id, self.settings.lease_s, aborted=end.aborted)
        if meta.loads or meta.cancels:
            for job in meta.loads:
                if self._failed_as_blocks:
                    self._load_blocks[job.request_id] = {b for g in job.plan.groups for b in g.local_block_ids}
                self.fetcher.submit(job)
            for request_id in meta.cancels:
                self.fetcher.cancel(request_id)

    def _run_tier(self, orders: TierOrders, transfers: dict[str, str]) -> None:
        """`transfers`: P's request id -> its transfer's, for the requests this step computes."""
        assert self.tier is not None, "host tier orders reached a worker without a tier: host_tier_bytes out of step"
        load_ns: dict[str, int] = {}  # request -> its loads' time this step (a load a group)
        spans: dict[str, tuple[int, int]] = {}  # request -> from its first load's start to its last's end
        for copy in orders.copies:
            try:
                if copy.op == "store":
                    self.tier.store(copy.keys, copy.block_ids)
                elif copy.op == "load":
                    if self.settings.break_prefix and copy.request_id.startswith(self.settings.break_prefix):
                        raise RuntimeError("fault injection: transfer.break_transfers_with_prefix")
                    took = self.tier.load(copy.keys, copy.block_ids)
                    load_ns[copy.request_id] = load_ns.get(copy.request_id, 0) + took
                    end = time.monotonic_ns()
                    spans[copy.request_id] = (spans.get(copy.request_id, (end - took, 0))[0], end)
                else:
                    self.tier.evict(copy.keys)
            except (KeyError, RuntimeError, MemoryError) as err:
                # A load that fails leaves its blocks to vLLM's kv_load_failure_policy (recompute them, or
                # end the request); a store that fails keeps nothing. Either way the book forgets the keys
                # the tier has no bytes for, and only those: a later order may read the others.
                log.error("host tier %s of %d blocks (request %s) failed: %s", copy.op, len(copy.hashes),
                          copy.request_id, err)
                if copy.op == "load":
                    self._error_blocks |= set(copy.block_ids)
                    self._tier_failed.append(copy.request_id)
                self._tier_lost += [k for k in copy.keys if k not in self.tier]
        self._tier_freed |= set(orders.free_after)
        if self.load_times is not None:  # P: for its engine actor
            for request_id, ns in load_ns.items():
                if (transfer_id := transfers.get(request_id)) is not None:
                    self.load_times.write(transfer_id, ns)
        if self.sources is None:  # D: in its transfer report
            self._tier_loads.update(spans)

    def open_pool(self, transfer_id: str, hashes: Sequence[bytes]) -> int:
        """A peer's read of a prompt's first blocks from this instance's host tier (issue 29's pool):
        the run of `hashes` (vLLM's block hashes, in prompt order) the tier holds in every group,
        pinned and offered as transfer `transfer_id` under the lease. The prompt tokens it covers
        (0: nothing held, nothing offered)."""
        if self.tier is None or self.sources is None:
            return 0
        run = self.tier.read_run(hashes, self.kv_groups)
        if (tokens := run.num_tokens) == 0:
            run.close()
            return 0
        try:
            self.sources.offer_pooled(transfer_id, run, tokens, self.settings.lease_s)
        except ValueError:
            run.close()
            raise
        return tokens

    def results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults(finished_sending=self.sources.take_finished() if self.sources else set())
        if self._tier_freed:
            out.finished_sending |= self._tier_freed
            self._tier_freed = set()
        if self.fetcher is not None:
            r = self.fetcher.take_results()
            out.finished_recving, out.failed_recving = r.finished, r.failed
            self._timings.update(r.timings)
            if self._failed_as_blocks:
                for request_id in r.failed:
                    self._error_blocks |= self._load_blocks.get(request_id, set())
                for request_id in r.finished:  # failed ones are in finished too
                    self._load_blocks.pop(request_id, None)
        return out

    def take_error_blocks(self) -> set[int]:
        out, self._error_blocks = self._error_blocks, set()
        return out

    def take_timings(self) -> PullTimings | None:
        if not self._timings and not self._tier_lost and not self._tier_failed and not self._tier_loads:
            return None
        out = PullTimings(self._timings, tuple(self._tier_lost), tuple(dict.fromkeys(self._tier_failed)),
                          self._tier_loads)
        self._timings, self._tier_lost, self._tier_failed, self._tier_loads = {}, [], [], {}
        return out

    def stop(self) -> None:
        for part in (self.server, self.fetcher):
            if part is not None:
                part.stop()
        if self.load_times is not None:
            self.load_times.close()
