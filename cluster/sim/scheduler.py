"""The simulated engine's scheduler in real time: one asyncio task per engine (`Scheduler.run`).

What each step computes is scheduler_core.py's (`SchedulerCore`, shared with the virtual
clock of cluster/sim/virtual/); this driver sleeps each step's modelled duration. Steps
run back to back on a modelled clock (each starts when the previous one ended there), so
the scheduler's own CPU time is absorbed instead of added, as long as it keeps up; after
an idle spell the clock restarts from now, and a step that starts more than `max_lag_s`
late restarts it too (counted in `lag_resets`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdcluster.cluster.sim.block_pool import BlockPool
from pdcluster.cluster.sim.request import Status
from pdcluster.cluster.sim.scheduler_config import KvHooks, ScheduledChunk, SchedulerConfig, StepCost
from pdcluster.cluster.sim.scheduler_core import SchedulerCore
from pdcluster.cluster.sim.tier import SimTier
from pdcluster.cluster.sim.variation import StepVariation

__all__ = ["KvHooks", "ScheduledChunk", "Scheduler", "SchedulerConfig", "StepCost"]

log = logging.getLogger(__name__)


class Scheduler(SchedulerCore):
    def __init__(self, config: SchedulerConfig, pool: BlockPool, cost: StepCost, hooks: KvHooks | None = None,
                 on_events=None, variation: StepVariation | None = None, tier: SimTier | None = None):
        super().__init__(config, pool, cost, hooks, on_events, clock_ns=time.monotonic_ns, variation=variation,
                         tier=tier)
        self.lag_resets = 0
        self._wake = asyncio.Event()
        self._stopped = False
        self._last_end: float | None = None  # the modelled clock: when the previous step ended

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        try:
            await self._loop()
        except Exception as err:
            # A bug in the loop must not leave callers waiting forever: end every request.
            log.exception("the scheduler loop failed")
            for req in list(self.waiting) + self.running:
                req.error = f"simulated engine failed: {err!r}"
                req.status = Status.FINISHED
                self._flush(req, "error")
            raise

    async def _loop(self) -> None:
        while not self._stopped:
            batch = self.begin_step()
            if not batch:
                self._last_end = None
                self._wake.clear()
                # Idle, or every waiting request waits for a load or for blocks: a load's end
                # and a release wake us; the timeout catches leases that expire.
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._sleep(self.step_times_s(batch)[0])
            except BaseException:
                self._in_step = False
                raise
            self.end_step(batch)
            await asyncio.sleep(0)  # let the actor's calls in even when steps cost 0 s

    async def _sleep(self, duration_s: float) -> None:
        now = time.monotonic()
        start = self._last_end if self._last_end is not None else now
        if now - start > self.config.max_lag_s:  # the CPU could not keep up: do not burst to catch up
            self.lag_resets += 1
            start = now
        self._last_end = start + duration_s
        delay = self._last_end - now
        if delay > 0:
            await asyncio.sleep(delay)
