"""The simulated engine's host KV tier (cluster/sim/tier.py) inside its scheduler core: write-through
on finish, a device miss loaded from the tier with its load time in the step, D's pull past it,
eviction and reset, and the events the router's index reads."""

from __future__ import annotations

import pytest
from test_sim_scheduler import LoadLater, RecordingCost

from pdcluster.cluster.sim.block_pool import BlockPool
from pdcluster.cluster.sim.cost import CostModel, SimParams, SimParamsError
from pdcluster.cluster.sim.kv_wire import BlockRemoved, BlockStored
from pdcluster.cluster.sim.request import SimRequest, Status
from pdcluster.cluster.sim.scheduler_config import KvHooks, SchedulerConfig
from pdcluster.cluster.sim.scheduler_core import SchedulerCore
from pdcluster.cluster.sim.tier import SimTier, host_tier
from pdcluster.proto.kv_event_wire import HOST_MEDIUM
from pdcluster.proto.messages import TierCounts

BS = 16
COST = CostModel(SimParams.load("cluster/sim/params/qwen3-8b-h200.yaml"), BS)


class Clock:
    def __init__(self):
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def core(blocks: int, tier_blocks: int | None, hooks: KvHooks | None = None, step_s: float = 0.01):
    """A scheduler core over `blocks` device blocks and a tier of `tier_blocks` (None: no tier), its
    clock, the step durations it asked for, and the events it published."""
    clock, events = Clock(), []
    tier = SimTier(tier_blocks * COST.block_bytes, COST, int_hashes=False) if tier_blocks is not None else None
    cfg = SchedulerConfig(block_size=BS, max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512,
                          vocab_size=1000, eos_token_id=None)
    c = SchedulerCore(cfg, BlockPool(blocks + 1, BS, int_hashes=False), RecordingCost(step_s), hooks,
                      on_events=events.extend, clock_ns=clock, tier=tier)
    return c, clock, events


def family(i: int, n: int = 8 * BS + 3) -> SimRequest:
    """Prompts of family i: the same tokens every time (a revisit hits)."""
    return SimRequest(f"f{i}-{id(object())}", [(1000 * i + t) % 997 for t in range(n)], max_tokens=1, ignore_eos=True)


def run(c: SchedulerCore, clock: Clock, req: SimRequest) -> list[float]:
    """Serve `req` alone to its end; each step's duration as the core priced it."""
    c.add(req)
    durations = []
    while req.status is not Status.FINISHED:
        batch = c.begin_step()
        assert batch, f"{req.request_id} stuck in {req.status}"
        durations.append(c.step_s(batch))
        clock.ns += round(durations[-1] * 1e9)
        c.end_step(batch)
    return durations


def test_a_family_the_device_dropped_comes_back_from_the_tier_with_its_load_in_the_step():
    c, clock, _ = core(blocks=9, tier_blocks=64)
    first = family(0)
    cold = run(c, clock, first)
    assert first.num_cached_tokens == 0 and first.num_tier_tokens == 0
    assert len(c.tier.book) == 8  # every full prompt block, written through on finish
    run(c, clock, family(1))  # 9 blocks of another family: family 0's blocks are evicted from the device
    assert c.pool.find_hit(first.block_hashes, 8 * BS) == []
    again = family(0)
    warm = run(c, clock, again)
    assert again.num_cached_tokens == again.num_tier_tokens == 8 * BS
    assert c.tier.loaded_blocks == 8
    # The admitting step computes 3 tokens and loads 8 blocks over the host link before it.
    assert warm[0] == pytest.approx(0.01 + COST.host_load_s(8 * COST.block_bytes))
    assert cold[0] == 0.01 and COST.host_load_s(8 * COST.block_bytes) > 0
    bb = COST.block_bytes  # the tier counts itself as the real one does (TierCounts)
    assert c.tier.counts() == TierCounts(16 * bb, 8, 8 * bb, COST.host_load_s(8 * bb), 16, 16 * bb, 0)


def test_a_device_hit_is_taken_first_and_the_tier_adds_only_the_run_past_it():
    c, clock, _ = core(blocks=40, tier_blocks=64)
    run(c, clock, family(0))
    again = family(0)
    run(c, clock, again)
    assert again.num_cached_tokens == 8 * BS and again.num_tier_tokens == 0  # all on the device


def test_the_tier_announces_its_blocks_apart_from_the_device_and_evicts_least_recent_first():
    c, clock, events = core(blocks=9, tier_blocks=10)
    a = family(0)
    run(c, clock, a)
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == HOST_MEDIUM]
    assert len(stored) == 1 and stored[0].block_hashes == a.block_hashes[:8] and stored[0].parent_block_hash is None
    assert stored[0].token_ids == a.prompt_token_ids[:8 * BS]
    events.clear()
    run(c, clock, family(1))  # 8 more blocks in a 10-block tier: 6 of family 0's go, its tail first
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == HOST_MEDIUM for h in e.block_hashes]
    assert removed == a.block_hashes[2:8][::-1]
    assert c.tier.evicted_blocks == 6 and len(c.tier.book) == 10
    again = family(0)
    run(c, clock, again)
    assert again.num_tier_tokens == 2 * BS  # its head survived


def test_d_loads_its_tier_run_and_pulls_only_the_rest():
    hooks = LoadLater()
    c, clock, _ = core(blocks=9, tier_blocks=64, hooks=hooks)
    run(c, clock, family(0))
    run(c, clock, family(1))  # family 0 out of the device, in the tier
    d = family(0)
    d.max_tokens, d.external_tokens = 2, d.num_prompt_tokens
    c.add(d)
    assert c.begin_step() == []  # admitted: loading
    assert hooks.started == [d] and d.hit_tokens == d.tier_tokens == 8 * BS and d.external_tokens == 3
    # Its tier hit loads in the step that starts the load, before the pull (as D's worker does):
    # that step pays it, and the pull's hooks are told how long it takes.
    assert c.loading_tier_tokens == 8 * BS and d.tier_load_ns == round(COST.host_load_s(8 * COST.block_bytes) * 1e9)
    c.load_ended(d.request_id, None)
    batch = c.begin_step()
    assert [(ch.req, ch.num_new_tokens, ch.tier_tokens) for ch in batch] == [(d, 1, 0)]  # paid once
    assert c.step_s(batch) == pytest.approx(0.01)


def test_a_reset_empties_the_tier_and_a_file_without_a_host_link_is_refused():
    c, clock, events = core(blocks=9, tier_blocks=64)
    run(c, clock, family(0))
    assert c.pool.reset()
    c.tier.clear()
    assert len(c.tier.book) == 0 and c.tier.book.used_bytes == 0
    assert [e for e in c.take_events() if isinstance(e, BlockRemoved) and e.medium == HOST_MEDIUM]
    assert host_tier(0, COST, False) is None and host_tier(None, COST, False) is None
    no_link = SimParams.load("cluster/sim/params/qwen3-0.6b-h200.yaml")
    with pytest.raises(SimParamsError, match="qwen3-0.6b-h200: no host_link"):
        host_tier(1, CostModel(no_link, BS), False)


class Written(KvHooks):
    """P's hooks: the prompt ranges each step wrote."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []

    def computed(self, req, start, end):
        self.ranges.append((start, end))


def test_the_step_that_loads_a_tier_run_reports_those_blocks_written_so_p_serves_them_to_d():
    hooks = Written()
    c, clock, _ = core(blocks=9, tier_blocks=64, hooks=hooks)
    run(c, clock, family(0))
    run(c, clock, family(1))
    hooks.ranges.clear()
    run(c, clock, family(0))
    assert hooks.ranges == [(0, 8 * BS + 3)]  # the 8 loaded blocks and the 3 computed tokens
