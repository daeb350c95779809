"""D's KV side in the simulated engine: what vLLM's KV connector does on a consumer.

When the scheduler has allocated a request's blocks past D's own prefix hit,
D plans which of P's blocks it needs per component (`CostModel.blocks_to_send`:
full and compressed past the hit, the window's and the state's tail) and pulls
them with the project's `KvFetcher` (transfer/grpc_client.py) from P's
KvServer, scaled bytes and all. When every block has arrived, D checks each
row's key (payload.py), then waits out the *modelled* transfer, the full-size
bytes over the modelled link (`link.modelled_end_ns`), before telling the
scheduler the KV is ready: the request sees max(real end, modelled end).

What it reports (`TransferStats`, on the request's last delta) counts blocks
per component and their modelled full-size bytes, not the scaled bytes that
moved (those are counted in its `_Load`, beside each chunk's arrival).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from pdcluster.cluster.sim import payload
from pdcluster.cluster.sim.cost import Component
from pdcluster.cluster.sim.link import LinkModel, modelled_end_ns
from pdcluster.cluster.sim.request import SimRequest
from pdcluster.cluster.sim.scheduler import KvHooks, Scheduler
from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import TransferStats
from pdcluster.transfer.grpc_client import KvFetcher, LoadJob
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.plan import GroupPlan, TransferPlan

log = logging.getLogger(__name__)

# Pulls in flight per D. In push mode a pull holds its thread from D's admission until P has
# computed the prompt, P's queue included; with fewer threads than such pulls, a pull whose P
# is done waits behind others still waiting for theirs (C90 on P8+D8: ~10 per D at a time).
FETCH_THREADS = 64

_PLAN_KIND = {"full": "full_attention", "compressed": "compressed", "window": "sliding_window",
              "state": "sliding_window"}  # state: its one tail block, as a window's tail


@dataclass
class _Load:
    """One request's load: its report (bytes modelled, full size; the end max(real end, modelled
    end)) and what really arrived."""

    stats: TransferStats
    scaled_bytes: int = 0  # what really moved
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (monotonic ns, modelled bytes) per chunk


class RecordingPagedKv(PagedKv):
    """D's cache: every write (one chunk from P) is also noted with its arrival time."""

    on_write = None  # (layer, block_ids, nbytes) -> None

    def write(self, layer, block_ids, data) -> None:
        super().write(layer, block_ids, data)
        if self.on_write is not None:
            self.on_write(layer, block_ids, len(data))


class _NotifyingFetcher(KvFetcher):
    """KvFetcher that says when a job ended (its results are then in take_results)."""

    def __init__(self, *args, on_done, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_done = on_done

    def _run(self, job: LoadJob, deadline: float) -> None:
        try:
            super()._run(job, deadline)
        finally:
            self._on_done(job.request_id)


class ConsumerSide(KvHooks):
    def __init__(self, engine_id: str, components: tuple[Component, ...], kv: RecordingPagedKv, block_size: int,
                 cost, timeout_s: float, loop: asyncio.AbstractEventLoop, secret: str, seal: bool = False):
        self.components = components
        self.kv = kv
        self.block_size = block_size
        self.cost = cost
        self.link = LinkModel.of(cost)
        self.loop = loop
        self.scheduler: Scheduler | None = None
        self.fetcher = _NotifyingFetcher(engine_id, kv, timeout_s, max_workers=FETCH_THREADS, secret=secret,
                                         seal=seal, on_done=lambda rid: loop.call_soon_threadsafe(self._collect))
        self.handles: dict[str, TransferHandle] = {}
        self.loads: dict[str, _Load] = {}
        self._planned: dict[str, tuple[GroupPlan, ...]] = {}
        self._owner: dict[int, str] = {}  # D block id -> the request loading into it
        self._lock = threading.Lock()
        self._component_of = {c.name: c for c in components}
        self.received_bytes = 0  # scaled bytes written into this D's blocks, over its lifetime
        kv.on_write = self._on_write

    def expect(self, request_id: str, handle: TransferHandle) -> None:
        self.handles[request_id] = handle

    def start_load(self, req: SimRequest) -> None:
        handle = self.handles[req.request_id]
        n, hit = handle.num_tokens, req.hit_tokens  # (a pool's handle covers the prompt's first blocks only)
        ids = list(req.blocks)
        groups = [GroupPlan(gi, _PLAN_KIND[c.kind], tuple(load), tuple(ids[i] for i in load))
                  for gi, (c, load) in enumerate(zip(self.components, self.cost.blocks_to_load(n, hit)))]
        plan = TransferPlan(tuple(groups), d_cached_tokens=hit, transferred_tokens=n - hit)
        # Its tier hit loads first, in the step that starts it (the model's time: the bytes stay put),
        # then the pull: the modelled transfer starts when the load ends.
        now = time.monotonic_ns()
        tier_load = dict(d_tier_load_start_ns=now, d_tier_loaded_ns=now + req.tier_load_ns) if req.tier_load_ns else {}
        self.loads[req.request_id] = _Load(replace(TransferStats.planned(
            hit, n - hit, tuple(g.num_blocks for g in groups), tuple(c.bytes_per_block for c in self.components),
            transfer_start_ns=now + req.tier_load_ns, group_names=tuple(c.name for c in self.components),
            d_tier_tokens=req.tier_tokens), **tier_load))
        self._planned[req.request_id] = tuple(groups)
        with self._lock:
            for g in groups:
                for b in g.local_block_ids:
                    self._owner[b] = req.request_id
        self.fetcher.submit(LoadJob(req.request_id, handle, plan))

    def _on_write(self, layer: str, block_ids, nbytes: int) -> None:  # fetcher threads
        with self._lock:
            rid = self._owner.get(block_ids[0])
            self.received_bytes += nbytes
        load = self.loads.get(rid) if rid is not None else None
        if load is not None:
            load.arrivals.append((time.monotonic_ns(), len(block_ids) * self._component_of[layer].bytes_per_block))
            load.scaled_bytes += nbytes

    def cancel_load(self, req: SimRequest) -> None:
        self.fetcher.cancel(req.request_id)

    def _collect(self) -> None:
        """A fetch ended (on the event loop): check it, then end the load once the modelled transfer has."""
        results = self.fetcher.take_results()
        for rid in results.finished:
            load = self.loads.get(rid)
            groups = self._planned.pop(rid, ())
            with self._lock:
                for g in groups:
                    for b in g.local_block_ids:
                        self._owner.pop(b, None)
            timing = results.timings.get(rid)
            real_end = timing.end_ns if timing else time.monotonic_ns()
            error = "KV pull from P failed" if rid in results.failed else None
            req = self.scheduler.requests.get(rid)
            if req is None or load is None:  # aborted meanwhile: the scheduler frees its blocks now
                self.scheduler.load_ended(rid, error or "cancelled")
                continue
            if error is None:
                error = self._verify(req, groups)
            stats = load.stats
            if error is not None:
                load.stats = stats.failed(error, end_ns=real_end, moved_bytes=(0,) * len(self.components))
                self.scheduler.load_ended(rid, error)
                continue
            # The arrivals pace the full-size bytes (transport grpc); over torch_dist D's writes are
            # not seen, and the whole transfer from its start is the floor.
            start = stats.transfer_start_ns
            floor_ns = start + int(self.cost.transfer_s(sum(stats.bytes_per_group)) * 1e9)
            end = max(real_end, floor_ns if not load.arrivals else modelled_end_ns(start, load.arrivals, self.link))
            load.stats = stats.pulled(start, end)
            self._end_load_at(rid, end)

    def _end_load_at(self, rid: str, end_ns: int) -> None:
        """The load ends at end_ns: timers fire early (uvloop's by up to a millisecond), so re-arm
        until the clock has passed it; a request never sees its KV before the modelled transfer ends."""
        delay_s = (end_ns - time.monotonic_ns()) / 1e9
        if delay_s > 0:
            self.loop.call_later(delay_s, self._end_load_at, rid, end_ns)
        else:
            self.scheduler.load_ended(rid, None)

    def _verify(self, req: SimRequest, groups: tuple[GroupPlan, ...]) -> str | None:
        keys = payload.block_keys(req.block_hashes, req.prompt_token_ids, self.block_size)
        for g, c in zip(groups, self.components):
            bad = payload.mismatched(self.kv, g.group, c.name, g.local_block_ids, keys[list(g.remote_indices)])
            if bad:
                return (f"KV from P does not match the prompt: component {c.name}, {len(bad)} of "
                        f"{g.num_blocks} blocks (D blocks {bad[:4]}...)")
        return None

    def take_report(self, request_id: str) -> TransferStats | None:
        self.handles.pop(request_id, None)
        load = self.loads.pop(request_id, None)
        return load.stats if load is not None else None

    def stop(self) -> None:
        self.fetcher.stop()
