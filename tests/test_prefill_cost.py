"""P's prefill time as the router predicts it (router/prefill_cost.py)."""

from __future__ import annotations

import pytest

from pdcluster.cluster.sim.calibrate import load
from pdcluster.cluster.sim.cost import CostModel
from pdcluster.router.prefill_cost import FittedCost, ModelledCost, shared_steps_s


def engine_s(cached: int, prompt: int, per_token: float = 2e-5, per_pair: float = 3e-10) -> float:
    new = prompt - cached
    return per_token * new + per_pair * new * (cached + new / 2)


def test_before_any_prefill_the_cost_is_linear_in_the_tokens_to_compute():
    cost = FittedCost()
    assert cost.seconds(0, 2000) == pytest.approx(2 * cost.seconds(0, 1000))
    assert cost.seconds(1000, 2000) == pytest.approx(cost.seconds(0, 1000))
    assert cost.seconds(2000, 2000) == 0


def test_the_fit_recovers_weights_and_attention_from_prefills_of_several_sizes():
    cost = FittedCost()
    for cached, prompt in ((0, 4096), (0, 16384), (12288, 16384), (0, 65536), (61440, 65536)):
        cost.observe(cached, prompt, engine_s(cached, prompt))
    assert cost.per_token_s == pytest.approx(2e-5, rel=1e-6) and cost.per_pair_s == pytest.approx(3e-10, rel=1e-6)
    # A warm 12K remainder over 118K of history against a cold 131K prefill: far more than 1/10.
    warm, cold = cost.seconds(118_000, 130_000), cost.seconds(0, 130_000)
    assert warm / cold == pytest.approx(engine_s(118_000, 130_000) / engine_s(0, 130_000))
    assert warm / cold > 1.3 * 12_000 / 130_000


def test_a_host_tier_hit_is_priced_by_what_its_loads_took_past_the_compute():
    cost = FittedCost()
    for cached, prompt in ((0, 4096), (0, 16384), (12288, 16384), (0, 65536), (61440, 65536)):
        cost.observe(cached, prompt, engine_s(cached, prompt))
    assert cost.per_tier_token_s == 0 and cost.seconds(61440, 65536, tier_tokens=61440) == cost.seconds(61440, 65536)
    for cached, prompt in ((12288, 16384), (61440, 65536)):  # all from the tier: 1e-7 s a token to load
        cost.observe(cached, prompt, engine_s(cached, prompt) + 1e-7 * cached, tier_tokens=cached)
    assert cost.per_tier_token_s == pytest.approx(1e-7, rel=1e-6)
    assert cost.per_token_s == pytest.approx(2e-5, rel=1e-6)  # the compute terms fitted to the others alone
    device, tier = cost.seconds(61440, 65536), cost.seconds(61440, 65536, tier_tokens=61440)
    assert tier - device == pytest.approx(61440 * 1e-7) and tier < cost.seconds(0, 65536)  # a load, not a prefill
    assert cost.taken_s(61440, 65536, 0, 0.0, tier_tokens=61440) == tier


def test_a_pool_read_is_priced_as_a_tier_token_until_one_is_seen_then_by_what_it_took():
    cost = FittedCost()
    for cached, prompt in ((0, 4096), (0, 16384), (12288, 16384), (0, 65536), (61440, 65536)):
        cost.observe(cached, prompt, engine_s(cached, prompt))
    for cached, prompt in ((12288, 16384), (61440, 65536)):
        cost.observe(cached, prompt, engine_s(cached, prompt) + 1e-7 * cached, tier_tokens=cached)
    assert cost.per_pool_token_s == pytest.approx(1e-7, rel=1e-6)  # none seen: a tier token's
    # Reads from a peer's tier (the network): 4e-7 s a token, past 4,096 tokens of P's own tier.
    for cached, prompt in ((12288, 16384), (61440, 65536)):
        pool = cached - 4096
        cost.observe(cached, prompt, engine_s(cached, prompt) + 1e-7 * 4096 + 4e-7 * pool, tier_tokens=4096,
                     pool_tokens=pool)
    assert cost.per_pool_token_s == pytest.approx(4e-7, rel=1e-6)
    assert cost.per_tier_token_s == pytest.approx(1e-7, rel=1e-6) and cost.per_token_s == pytest.approx(2e-5, rel=1e-6)
    assert cost.seconds(61440, 65536, 0, pool_tokens=61440) - cost.seconds(61440, 65536) == pytest.approx(61440 * 4e-7)


def test_one_size_seen_gives_the_linear_fit_and_a_full_hit_teaches_nothing():
    cost = FittedCost()
    for _ in range(3):
        cost.observe(0, 4096, 0.5)
    cost.observe(4096, 4096, 9.0)  # nothing computed: not an observation
    assert cost.per_pair_s == 0 and cost.seconds(0, 4096) == pytest.approx(0.5)


def test_the_coefficients_never_go_negative():
    # Long prompts faster per token than short ones (say, a warm-up in the first): no negative attention.
    cost = FittedCost()
    for n, s in ((1000, 1.0), (2000, 1.2), (4000, 1.6)):
        cost.observe(0, n, s)
    assert cost.per_token_s >= 0 and cost.per_pair_s >= 0
    assert cost.seconds(0, 2000) > 0


def test_the_fit_follows_the_engine_over_its_window():
    cost = FittedCost(window=8)
    for n in (1000, 2000, 4000, 8000) * 2:
        cost.observe(0, n, engine_s(0, n))
    for n in (1000, 2000, 4000, 8000) * 2:  # the engine got twice as slow: only this is in the window
        cost.observe(0, n, 2 * engine_s(0, n))
    assert cost.seconds(0, 3000) == pytest.approx(2 * engine_s(0, 3000))


def test_the_simulated_engine_is_predicted_by_its_own_cost_model():
    model = CostModel(load("dsv4-flash-910c"), 128)
    cost = ModelledCost(model, 8192)
    assert cost.seconds(0, 131_072) == pytest.approx(model.prefill_s(131_072, 0, 8192))
    assert cost.seconds(118_784, 131_072) == pytest.approx(model.prefill_s(12_288, 118_784, 8192))
    assert cost.seconds(131_072, 131_072) == 0
    # 9% of the tokens, well over 9% of the time: the history's attention.
    assert cost.seconds(118_784, 131_072) / cost.seconds(0, 131_072) > 0.1


def test_a_prompt_behind_queued_work_shares_its_first_step_and_under_load_its_last():
    # 16K budget; 10K queued (2 s alone), 12K own (3 s alone): its first step holds the queue's
    # 10K and 6K of its own, its last its other 6K (less than a step queued: P is not under load).
    assert shared_steps_s(10_000, 2.0, 12_000, 3.0, 16_000) == pytest.approx(2.0 + 3.0)
    # 26K queued ends 10K into a step, only that tail shares the prompt's first step; more than a
    # step queued: the arrivals after it fill its last step's other 10K too (at its own rate).
    assert shared_steps_s(26_000, 5.2, 12_000, 3.0, 16_000) == pytest.approx(2.0 + 3.0 + 10_000 * 3.0 / 12_000)
    # A queue ending on a step's boundary and a prompt filling its steps: nothing shared.
    assert shared_steps_s(16_000, 1.0, 16_000, 3.0, 16_000) == pytest.approx(3.0)
    assert shared_steps_s(0, 0.0, 12_000, 3.0, 16_000) == 3.0  # an idle P: alone
    assert shared_steps_s(10_000, 2.0, 0, 0.0, 16_000) == 0.0  # a full hit computes nothing


def test_the_modelled_cost_takes_its_own_prefill_alone_and_shares_steps_behind_a_queue():
    cost = ModelledCost(CostModel(load("dsv4-flash-910c"), 128), 16384)
    alone = cost.seconds(118_784, 131_072)
    assert cost.taken_s(118_784, 131_072, 0, 0.0) == alone
    assert cost.taken_s(118_784, 131_072, 12_288, alone) == pytest.approx(2 * alone)  # its first step shared
    # 28,672 queued: its last 12,288 in the prompt's first step, 8,192 after it in its last.
    assert cost.taken_s(118_784, 131_072, 28_672, 3 * alone) == pytest.approx(3 * alone * 12_288 / 28_672 + alone
                                                                           + 8_192 * alone / 12_288)
    assert FittedCost().taken_s(0, 1000, 5000, 9.0) == FittedCost().seconds(0, 1000)  # its times are such already
