"""The load on the virtual clock: `pdc bench run`'s phases, arrivals and concurrency cap.

As cluster/replay/run.py and cluster/replay/driver.py do it: phases one after the other, each drained before
the next (warm-up, seed, check, formal); in each, requests arrive at `send_offsets` (the
driver's own generator: a trace's timestamps, or gamma gaps at `request_rate`, seeded the
same; seed and check phases all at once), wait first come first served for one of
`max_concurrency` slots, and count from when they are sent; past `duration_s` nothing more is
sent. Each request ends as the driver's `RequestResult`, its chunks the tokens' times,
so cluster/replay/metrics.py computes the figures from the same numbers. Not modelled: the HTTP hop
(client, router and engines share one clock, and a token reaches the client when it is
made) and resending after a 429.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from pdcluster.cluster.replay.driver import DriveConfig, send_offsets
from pdcluster.cluster.replay.records import BenchRequest, RequestResult
from pdcluster.cluster.replay.run import PHASE_ORDER, BenchConfig
from pdcluster.cluster.sim.virtual.events import EventLoop
from pdcluster.cluster.sim.virtual.prompts import PromptCache
from pdcluster.cluster.sim.virtual.router import VirtualRouter
from pdcluster.proto.load_phases import replay_request_id
from pdcluster.router.timeline import RequestRecord


def phase_drive(cfg: BenchConfig, phase: str) -> DriveConfig:
    """The driver's settings for one phase, as run_bench makes them."""
    drive = DriveConfig(base_url="virtual", max_concurrency=cfg.max_concurrency, request_rate=cfg.request_rate,
                        burstiness=cfg.burstiness, duration_s=cfg.duration_s,
                        follow_timestamps=bool(cfg.trace) and not cfg.closed_loop, seed=cfg.seed, progress=False)
    if phase in ("formal", "warmup"):
        return drive
    return dataclasses.replace(drive, request_rate=None, duration_s=None, follow_timestamps=False)


def result_of(req: BenchRequest, rec: RequestRecord) -> RequestResult:
    """What the client would have observed of a request, from its record."""
    ev = rec.events
    ok = rec.error is None
    cached = (rec.d_cached_tokens + rec.pool_tokens if rec.local_prefill else rec.p_cached_tokens) if ok else None
    return RequestResult(index=req.index, phase=req.phase, prompt_tokens=len(req.prompt_token_ids),
                         start_s=ev["arrival"] / 1e9, end_s=ev["finish"] / 1e9, request_id=rec.request_id,
                         output_tokens=rec.output_tokens, chunk_s=[t / 1e9 for t in rec.token_ns],
                         chunk_tokens=[1] * len(rec.token_ns), cached_tokens=cached,
                         expected_cached_tokens=req.expected_cached_tokens, error=rec.error,
                         rejections=int(bool(rec.error and rec.error.startswith("429"))),
                         rejected=bool(rec.error and rec.error.startswith("429")))


class VirtualClient:
    def __init__(self, loop: EventLoop, router: VirtualRouter, prompts: PromptCache, cfg: BenchConfig,
                 on_phase: Callable[[str, int], None] | None = None):
        self.loop, self.router, self.prompts, self.cfg = loop, router, prompts, cfg
        self.on_phase = on_phase  # (phase, requests) as each phase starts: progress
        self.results: list[RequestResult] = []
        self.records: list[RequestRecord] = []
        self._phases: deque[tuple[str, list[BenchRequest]]] = deque()

    def start(self, requests: list[BenchRequest]) -> None:
        """Queue the load's phases; the event loop then runs them."""
        for phase in PHASE_ORDER:
            batch = [r for r in requests if r.phase == phase]
            if batch:
                self._phases.append((phase, batch))
        self._next_phase()

    def _next_phase(self) -> None:
        if not self._phases:
            return
        phase, batch = self._phases.popleft()
        if self.on_phase is not None:
            self.on_phase(phase, len(batch))
        _Phase(self, batch, phase_drive(self.cfg, phase)).start()


class _Phase:
    def __init__(self, client: VirtualClient, batch: list[BenchRequest], drive: DriveConfig):
        self.client, self.batch, self.drive = client, batch, drive
        self.loop = client.loop
        self.free = drive.max_concurrency or len(batch)  # no cap: a slot for every request
        self.queue: deque[BenchRequest] = deque()  # arrived, waiting for a slot
        self.left = len(batch)  # not yet ended (or dropped)
        self.deadline_ns: int | None = None

    def start(self) -> None:
        t0 = self.loop.now_ns
        if self.drive.duration_s is not None:
            self.deadline_ns = t0 + round(self.drive.duration_s * 1e9)
        for req, offset_s in zip(self.batch, send_offsets(self.batch, self.drive)):
            self.loop.at(t0 + round(offset_s * 1e9), lambda req=req: self._arrive(req))

    def _past_deadline(self) -> bool:
        return self.deadline_ns is not None and self.loop.now_ns >= self.deadline_ns

    def _arrive(self, req: BenchRequest) -> None:
        if self._past_deadline():  # the driver sends nothing after the window
            self._ended()
            return
        self.queue.append(req)
        self._send()

    def _send(self) -> None:
        while self.free and self.queue:
            req = self.queue.popleft()
            if self._past_deadline():  # its slot came after the window closed: never sent
                self._ended()
                continue
            self.free -= 1
            rid = f"cmpl-{replay_request_id('sim', req.phase, req.index)}"
            self.client.router.submit(rid, self.client.prompts.prepare(req), req.output_len,
                                      lambda rec, req=req: self._done(req, rec))

    def _done(self, req: BenchRequest, rec: RequestRecord) -> None:
        self.client.records.append(rec)
        self.client.results.append(result_of(req, rec))
        self.free += 1
        self._ended()
        self._send()

    def _ended(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.client._next_phase()
