"""One simulated P or D instance on the virtual clock: the scheduler core, stepped by events.

`VirtualInstance` does what scheduler.py's real-time loop does, with the virtual clock:
begin a step, let its modelled time pass (an event at its end), end it, begin the next
one at once. KV cache events leave at the end of the step whose schedule or end made them,
as the real-time engine publishes them.

Runs of identical decode steps (`SchedulerCore.repeatable_steps`: the same batch decoding,
nothing admitted, no block allocated or cached, nobody finishing before the last) are one
event, their times from `CostModel.decode_steps_s`, equal to the bit to the steps one by
one. Anything that comes in from outside meanwhile (an arrival, a load's end, a release)
cuts the run at the step it falls in, exactly where the scheduler would have seen it; so
the outcome is the same as stepping one by one (tests/test_sim_virtual.py checks it).

Output tokens: the first as the real-time engine draws it (request.py, from the prompt),
then the same id again. Nothing in a replayed load depends on output ids (requests ignore
EOS and have no stop ids, and no prompt contains a simulated output); drawing each one
would cost ~4 us a token, most of a C90 replay's time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

from pdcluster.cluster.sim.block_pool import BlockPool
from pdcluster.cluster.sim.kv_wire import BlockHash
from pdcluster.cluster.sim.request import SimRequest
from pdcluster.cluster.sim.scheduler_config import KvHooks, ScheduledChunk, SchedulerConfig, StepCost
from pdcluster.cluster.sim.scheduler_core import SchedulerCore
from pdcluster.cluster.sim.tier import SimTier
from pdcluster.cluster.sim.variation import StepVariation
from pdcluster.cluster.sim.virtual.events import STEP, EventLoop
from pdcluster.router.prefix_index import chain_hashes


class VirtualScheduler(SchedulerCore):
    """The scheduler core with the virtual clock's time and cheap output ids (module docstring)."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, cost: StepCost, hooks: KvHooks | None,
                 on_events: Callable[[list], None] | None, loop: EventLoop, variation: StepVariation | None = None,
                 tier: SimTier | None = None):
        super().__init__(config, pool, cost, hooks, on_events, clock_ns=lambda: loop.now_ns, variation=variation,
                         tier=tier)
        self.ends_ns: tuple[int, ...] = ()  # the ends of the repeated steps being ended

    def step_ends_ns(self, steps: int) -> tuple[int, ...]:
        assert len(self.ends_ns) == steps, f"{steps} steps ended, {len(self.ends_ns)} end times known"
        return self.ends_ns

    def hash_blocks(self, tokens: Sequence[int], known: list[BlockHash]) -> list[BlockHash]:
        """The router's chain (prompts.py: the virtual pools key their blocks by it; its indexes
        then take a stored block's key as its hash, router.py)."""
        return chain_hashes(tokens, self.config.block_size, known)

    def _draw_tokens(self, req: SimRequest, n: int) -> list[int]:
        token = req.output_token_ids[0] if req.output_token_ids else req.next_token(self.config.vocab_size)
        out = [token] * n
        req.output_token_ids += out
        return out


class VirtualInstance:
    def __init__(self, name: str, role: str, ordinal: int, loop: EventLoop, core: VirtualScheduler,
                 repeat_steps: bool = True):
        """`ordinal`: the instance's place among all (P first), which breaks ties between step ends
        at one time. `repeat_steps`: run repeatable decode steps as one event (the same outcome)."""
        self.name, self.role, self.ordinal = name, role, ordinal
        # What a transfer handle names (router/lifecycle.py): no network here, the name stands for both.
        self.engine_id, self.kv_address = name, f"{name}:0"
        self.loop, self.core = loop, core
        self.repeat_steps = repeat_steps
        self.busy_ns = 0  # time spent in steps
        self.events = 0  # step-end events (a run of repeated steps counts once)
        self._batch: list[ScheduledChunk] | None = None  # the step (or run) under way
        self._ends: tuple[int, ...] = ()
        self._start_ns = 0
        self._generation = 0  # bumped when a run is cut: its old end event is void
        self._starting = False  # a begin is scheduled for now
        self._schedule_events: list = []  # the running step's schedule made them: out at its end

    # -- from outside (each may change what the next step schedules)

    def add(self, req: SimRequest) -> None:
        self.core.add(req)
        self._touched()

    def load_ended(self, request_id: str, error: str | None) -> None:
        self.core.load_ended(request_id, error)
        self._touched()

    def release(self, request_ids: set[str]) -> None:
        self.core.release(request_ids)
        self._touched()

    def _touched(self) -> None:
        if self._batch is None:
            self._begin_soon()
            return
        # Inside a run of repeated steps: it ends with the step under way now.
        j = bisect_left(self._ends, self.loop.now_ns)
        if j < len(self._ends) - 1:
            self._ends = self._ends[:j + 1]
            self._generation += 1
            self._at_end()

    # -- stepping

    def _begin_soon(self) -> None:
        """Begin a step now, after whatever else happens at this very time (as the real-time
        loop yields to the actor's calls between two steps)."""
        if not self._starting:
            self._starting = True
            self.loop.at(self.loop.now_ns, self._begin, STEP, self.ordinal)

    def _begin(self) -> None:
        self._starting = False
        if self._batch is not None:
            return
        core = self.core
        batch = core.begin_step()
        if not batch:
            return  # idle until touched
        self._schedule_events = core.take_events()
        steps = core.repeatable_steps(batch) if self.repeat_steps else 1
        durations = core.step_times_s(batch, steps)
        t, ends = self.loop.now_ns, []
        for d in durations:
            t += round(d * 1e9)
            ends.append(t)
        self._batch, self._ends, self._start_ns = batch, tuple(ends), self.loop.now_ns
        self._generation += 1
        if steps > 1 and self._schedule_events:
            self.loop.at(ends[0], self._publish_schedule_events, STEP, self.ordinal)
        self._at_end()

    def _at_end(self) -> None:
        generation = self._generation
        self.loop.at(self._ends[-1], lambda: self._end(generation), STEP, self.ordinal)

    def _publish_schedule_events(self) -> None:
        events, self._schedule_events = self._schedule_events, []
        if events and self.core.on_events is not None:
            self.core.on_events(events)

    def _end(self, generation: int) -> None:
        if generation != self._generation:
            return  # a run cut short: its end came earlier
        self._publish_schedule_events()
        batch, self._batch = self._batch, None
        self.core.ends_ns = self._ends
        self.busy_ns += self.loop.now_ns - self._start_ns
        self.events += 1
        self.core.end_step(batch, len(self._ends))
        self._begin_soon()
