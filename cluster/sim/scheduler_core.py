"""The simulated engine's scheduler, without time: vLLM-like continuous batching.

`SchedulerCore` decides what each step computes, as vLLM 0.32's v1 scheduler does:
- running requests first (prompt chunks, or one token to decode each), then
  waiting ones in arrival order (FCFS) while fewer than `max_num_seqs` run and
  the step's `max_num_batched_tokens` budget lasts; a prompt longer than what is
  left is chunked (also at `long_prefill_token_threshold` per request, vLLM's cap);
- a waiting request first takes its prefix-cache hit (block_pool.py), then blocks
  for the tokens it computes this step; its full blocks become hittable as soon
  as they are scheduled, as in vLLM;
- a request whose KV comes from elsewhere (D: `external_tokens`) takes blocks for
  the whole prompt and waits, outside the running set, until `KvHooks` says the
  load ended; then its last prompt token is computed (vLLM recomputes it for its
  logits) and it decodes;
- out of blocks, the latest running request is preempted (its blocks freed, its
  tokens recomputed later, with whatever prefix hit it then has); a prompt that
  could never fit fails at once rather than waiting forever.

Time is the driver's: it calls `begin_step` (the batch), lets the step's modelled
duration (`step_s`) pass, sets the clock (`clock_ns`) and calls `end_step`. Two
drivers share this core: scheduler.py's `Scheduler` sleeps in real time inside
the engine actor; cluster/sim/virtual/ advances a virtual clock, and may run
several identical decode steps at once (`repeatable_steps`), with exactly the
outcome of running them one by one.

Tokens are request.py's pseudo-random ids; EOS, stop ids, max_tokens and
max_model_len end a request as in vLLM. Each request's tokens go out in
batches (`Delta`, put on `req.out`): its first token at once, then at most one
batch per `delta_interval_s`, each token with the time its step ended.

What the KV does around a step (P: mark blocks ready for D; D: fetch them) is the
`KvHooks` object's business (engine.py), as vLLM's is its KV connector's. A step's shape and
duration, and which steps repeat, are scheduler_steps.py's; its outputs scheduler_outputs.py's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from pdcluster.cluster.sim.block_pool import BlockPool, OutOfBlocks, hash_blocks
from pdcluster.cluster.sim.kv_wire import BlockHash
from pdcluster.cluster.sim.request import SimRequest, Status
from pdcluster.cluster.sim.scheduler_config import KvHooks, ScheduledChunk, SchedulerConfig, StepCost
from pdcluster.cluster.sim.scheduler_outputs import StepOutputs
from pdcluster.cluster.sim.scheduler_steps import StepShapes
from pdcluster.cluster.sim.tier import SimTier
from pdcluster.cluster.sim.variation import StepVariation

log = logging.getLogger(__name__)


class SchedulerCore(StepShapes, StepOutputs):
    def __init__(self, config: SchedulerConfig, pool: BlockPool, cost: StepCost, hooks: KvHooks | None = None,
                 on_events=None, clock_ns: Callable[[], int] = time.monotonic_ns,
                 variation: StepVariation | None = None, tier: SimTier | None = None):
        """`clock_ns`: the time every timestamp is taken from (the real-time loop: the host's
        monotonic clock; the virtual clock: its own). `variation`: how step times vary around the
        cost model's (cluster/sim/variation.py); None: not at all. `tier`: the instance's host KV
        tier (cluster/sim/tier.py); None: none."""
        assert pool.block_size == config.block_size, "pool and scheduler disagree on the block size"
        self.config = config
        self.pool = pool
        self.tier = tier
        self.loading_tier_tokens = 0  # (set by each _schedule)
        self.cost = cost
        self.variation = variation
        self.hooks = hooks or KvHooks()
        self.on_events = on_events  # called with each step's KV cache events (list), if any
        self.waiting: deque[SimRequest] = deque()  # WAITING and LOADING, in arrival order
        self.running: list[SimRequest] = []
        self.held: dict[str, SimRequest] = {}  # finished, blocks kept for a transfer
        self.requests: dict[str, SimRequest] = {}  # every request not yet done with its blocks
        self.steps = 0
        self.preemptions = 0  # running requests put back for lack of KV blocks
        self.now_ns = clock_ns
        self._in_step = False  # a step is being computed (between its schedule and its end)
        self._aborts: set[str] = set()  # aborts that came during the step: applied after it

    # ------------------------------------------------------------------ requests in and out

    def add(self, req: SimRequest) -> SimRequest:
        c = self.config
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running on this engine")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if req.num_prompt_tokens >= c.max_model_len:
            raise ValueError(f"request {req.request_id}: prompt of {req.num_prompt_tokens} tokens does not fit "
                             f"max_model_len {c.max_model_len} (one token at least must be generated)")
        low, high = req.id_range
        if low < 0 or high >= c.vocab_size:
            raise ValueError(f"request {req.request_id}: token ids {low}..{high} outside the vocabulary "
                             f"(0..{c.vocab_size - 1})")
        needed = -(-(req.num_prompt_tokens + 1) // c.block_size)
        if needed > self.pool.num_blocks - 1:
            raise ValueError(f"request {req.request_id}: its prompt needs {needed} KV blocks, the pool has "
                             f"{self.pool.num_blocks - 1}: raise sim.kv_blocks or shorten the prompt")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.request_id}: max_tokens {req.max_tokens} < 1")
        # Hashed once, here: the whole prompt's full blocks (unless the caller did already).
        if req.block_hashes:
            assert len(req.block_hashes) == req.num_prompt_tokens // c.block_size, (
                f"request {req.request_id}: {len(req.block_hashes)} block hashes given for "
                f"{req.num_prompt_tokens} prompt tokens: hashed with another block size?")
        else:
            req.block_hashes = self.hash_blocks(req.prompt_token_ids, [])
        req.queued_ns = self.now_ns()
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.wake()
        return req

    def abort(self, request_id: str) -> None:
        """The caller no longer wants `request_id` (client gone): end it, free what it holds.
        As in vLLM, between steps: a request in the step being computed ends after it, since
        the blocks that step fills are already hittable by others (and, on P, wanted by D)."""
        if self._in_step:
            self._aborts.add(request_id)
            return
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, "abort")

    def load_ended(self, request_id: str, error: str | None) -> None:
        """KvHooks: the load of `request_id` ended (error None: every block arrived)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.kv_ready_ns = self.now_ns()
        if req.status is Status.FINISHED:  # aborted while loading: its blocks were kept until now
            self._free_blocks(req)
            return
        assert req.status is Status.LOADING, f"load of {request_id} ended while it was {req.status}"
        if error is None:
            req.num_computed_tokens = req.hit_tokens + req.external_tokens
            if req.num_computed_tokens >= req.num_tokens:  # vLLM recomputes the last token for its logits
                req.num_computed_tokens = req.num_tokens - 1
            self._cache_blocks(req, req.num_computed_tokens)
        else:
            req.error = error
            req.num_computed_tokens = req.hit_tokens  # recompute: what the blocks past the hit hold is garbage
        req.external_tokens = 0
        req.status = Status.WAITING
        if error is not None and not self.config.recompute_on_load_failure:
            if req in self.waiting:  # (not while it is being admitted: its load failed as it started)
                self.waiting.remove(req)
            self._finish(req, "error")
        self.wake()

    def release(self, request_ids: set[str]) -> None:
        """KvHooks: these finished requests' blocks may be freed now."""
        for rid in request_ids:
            req = self.held.pop(rid, None)
            if req is not None:
                req.held_for_transfer = False
                self._free_blocks(req)

    def wake(self) -> None:
        """Something a waiting request waits for changed (an arrival, a load's end, a release):
        the driver runs a step soon if it is idle. The core needs nothing of it."""

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ steps (the drivers' interface)

    def begin_step(self) -> list[ScheduledChunk]:
        """What the next step computes (empty: nothing to run now). A non-empty batch must be
        followed by `end_step` once the step's time has passed."""
        self.hooks.poll()
        self._publish_events()  # also those of loads and releases between steps
        batch = self._schedule()
        self._in_step = bool(batch)
        return batch

    def end_step(self, batch: list[ScheduledChunk], steps: int = 1) -> None:
        """The step (or `steps` identical ones, see `repeatable_steps`) ended at now_ns()."""
        try:
            self._after_step(batch, steps)
        finally:
            self._in_step = False
        for request_id in self._aborts:
            self._abort_now(request_id)
        self._aborts.clear()
        self.steps += steps
        self._publish_events()

    def hash_blocks(self, tokens: Sequence[int], known: list[BlockHash]) -> list[BlockHash]:
        """The pool's keys for every full block of `tokens`, extending `known` (its first
        blocks', worked out before): vLLM's chained hashes."""
        return hash_blocks(tokens, self.config.block_size, known)

    def take_events(self) -> list:
        """The KV cache events since the last take: the pool's, then its host tier's."""
        events = self.pool.take_events()
        if self.tier is not None:
            events += self.tier.take_events()
        return events

    def _publish_events(self) -> None:
        events = self.take_events()
        if events and self.on_events is not None:
            self.on_events(events)

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[ScheduledChunk]:
        c = self.config
        self.loading_tier_tokens = 0  # the tier loads of loads this step starts: the step pays them
        budget = c.max_num_batched_tokens
        batch: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new(req, budget)
            while not self._allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.append(ScheduledChunk(req, n))
                budget -= n
                i += 1
                continue
            break  # req preempted itself
        if preempted:
            return batch
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            req = self.waiting.popleft()
            if req.status is Status.LOADING:
                skipped.append(req)
                continue
            if not req.blocks:  # admission: first time, or after a preemption
                if not self._admit(req, budget):
                    skipped.append(req)
                    break  # head of line waits for blocks, as in vLLM
                if req.status is Status.LOADING:
                    skipped.append(req)
                    continue
                if req.status is Status.FINISHED:  # its load failed as it started, and it ended
                    continue
                n = self._num_new(req, budget)
            else:
                n = self._num_new(req, budget)
                if not self._allocate(req, n):
                    skipped.append(req)
                    break
            req.status = Status.RUNNING
            if req.scheduled_ns == 0:
                req.scheduled_ns = self.now_ns()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.running.append(req)
            batch.append(ScheduledChunk(req, n, req.tier_load_tokens))  # its tier hit loads in this step
            req.tier_load_tokens = 0
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _num_new(self, req: SimRequest, budget: int) -> int:
        return self._num_new_from(req, req.num_computed_tokens, budget)

    def _num_new_from(self, req: SimRequest, num_computed: int, budget: int) -> int:
        n = req.num_tokens - num_computed
        if 0 < self.config.long_prefill_token_threshold < n:
            n = self.config.long_prefill_token_threshold
        return max(1, min(n, budget))

    def _admit(self, req: SimRequest, budget: int) -> bool:
        """Take the prefix-cache hit and blocks for this step's tokens (for a load: the whole
        prompt's, then start it). All or nothing, as vLLM's allocate_slots: False leaves the
        pool as it was (a request that holds blocks while it waits could deadlock the pool)."""
        bs = self.config.block_size
        if len(req.block_hashes) < req.num_tokens // bs:  # preempted with output tokens since hashed
            req.block_hashes = self.hash_blocks(req.token_view(), req.block_hashes)
        hit = self.pool.find_hit(req.block_hashes, req.num_tokens - 1)
        tier_blocks = self.tier.lookup(req.block_hashes, len(hit), req.num_tokens - 1) if self.tier else 0
        hit_tokens = (len(hit) + tier_blocks) * bs
        loads = req.external_tokens > hit_tokens
        end = req.num_prompt_tokens if loads else hit_tokens + self._num_new_from(req, hit_tokens, budget)
        needed = -(-end // bs) - len(hit)
        blocks = self.pool.admit(hit, needed)
        if blocks is None:
            return False
        req.blocks = blocks
        req.num_cached_blocks = len(hit)
        req.hit_tokens = req.num_computed_tokens = hit_tokens
        req.tier_tokens = req.tier_load_tokens = tier_blocks * bs
        if tier_blocks:
            self.tier.loaded(tier_blocks)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens, req.num_tier_tokens = hit_tokens, req.tier_tokens
        if not loads:
            req.external_tokens = 0
            self._cache_blocks(req, end)
            return True
        req.external_tokens -= hit_tokens
        req.status = Status.LOADING
        if req.tier_load_tokens:  # loaded in this step, before the pull starts
            req.tier_load_ns = round(self.tier.load_s(req.tier_load_tokens) * 1e9)
            self.loading_tier_tokens += req.tier_load_tokens
            req.tier_load_tokens = 0
        try:
            self.hooks.start_load(req)
        except Exception as err:  # noqa: BLE001  (the load's failure is the request's, never the engine's)
            log.error("load of %s could not start: %s", req.request_id, err)
            self.load_ended(req.request_id, f"KV load could not start: {err}")
        return True

    def _allocate(self, req: SimRequest, num_new: int) -> bool:
        """Blocks for `req`'s tokens up to num_computed + num_new; cache the full ones (vLLM
        caches at schedule time). False if the pool is short."""
        bs = self.config.block_size
        end = req.num_computed_tokens + num_new
        needed = -(-end // bs) - len(req.blocks)
        if needed > 0:
            try:
                req.blocks += self.pool.allocate(needed)
            except OutOfBlocks:
                return False
        self._cache_blocks(req, end)
        return True

    def _cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        bs = self.config.block_size
        full = num_tokens // bs
        if full <= req.num_cached_blocks:
            return
        if len(req.block_hashes) < full:  # output tokens filled a block
            req.block_hashes = self.hash_blocks(req.token_view(), req.block_hashes)[:full]
        tokens = req.prompt_token_ids if full * bs <= req.num_prompt_tokens else req.token_view()
        self.pool.cache_full_blocks(req.blocks, req.block_hashes, req.num_cached_blocks, full, tokens)
        req.num_cached_blocks = full

    def _preempt(self, req: SimRequest) -> None:
        log.info("preempting %s (%d blocks) for lack of KV blocks", req.request_id, len(req.blocks))
        self.hooks.preempted(req)
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _free_blocks(self, req: SimRequest) -> None:
        self.pool.free(req.blocks[::-1])  # tail first: evicted first
        req.blocks = []
        req.num_cached_blocks = 0
        if req.status is Status.FINISHED and not req.held_for_transfer:
            self.requests.pop(req.request_id, None)
