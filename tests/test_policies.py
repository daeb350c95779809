"""Routing choices (router/policies.py) on hand-made instance views."""

from __future__ import annotations

import pytest

from pdcluster.router.policies import DecodeView, PrefillView, pick_decode, pick_prefill


def pv(name: str, matched: int = 0, queued: int = 0, requests: int = 0, queued_s: float = 0.0,
       prefill_s: float = 0.0) -> PrefillView:
    return PrefillView(name, matched, queued, requests, queued_s, prefill_s)


P = [pv("p0", 0, 0, prefill_s=1.0), pv("p1", 900, 500, queued_s=0.5, prefill_s=0.1),
     pv("p2", 0, 2_000, queued_s=2.0, prefill_s=1.0)]


def test_round_robin_ignores_cache_and_load():
    assert [pick_prefill("round_robin", P, t).name for t in range(4)] == ["p0", "p1", "p2", "p0"]


def test_least_load_picks_the_shortest_queue():
    assert pick_prefill("least_load", P, 0).name == "p0"


def test_prefix_aware_trades_the_prefill_time_saved_against_the_queue():
    # p1: 2 x 0.1 s to compute + 0.5 s queued = 0.7 s < p0's 2 x 1.0 s: the cache wins.
    assert pick_prefill("prefix_aware", P, 0).name == "p1"
    # A queue on p1 longer than twice what the prefix saves there (2 x (1.0 - 0.1) s): the idle P wins.
    busy = [P[0], pv("p1", 900, 0, queued_s=1.81, prefill_s=0.1)]
    assert pick_prefill("prefix_aware", busy, 0).name == "p0"
    # Up to that, the request waits behind p1's queue and hits.
    sticky = [P[0], pv("p1", 900, 0, queued_s=1.79, prefill_s=0.1)]
    assert pick_prefill("prefix_aware", sticky, 0).name == "p1"


def test_prefix_aware_weighs_time_not_tokens():
    """A warm remainder over a long history costs far more than its share of tokens (its
    attention over the history): 10% of the tokens at 13% of the cold time (docs/sim.md's
    1.09 s vs 8.43 s). By tokens, the holder would win with up to 1.8 cold prefills queued;
    by time it wins only up to 2 x (8.43 - 1.09) s = 1.74 of them."""
    cold, warm = 8.43, 1.09
    holder = pv("holder", 118_000, 0, queued_s=1.76 * cold, prefill_s=warm)
    assert pick_prefill("prefix_aware", [pv("idle", prefill_s=cold), holder], 0).name == "idle"
    holder = pv("holder", 118_000, 0, queued_s=1.72 * cold, prefill_s=warm)
    assert pick_prefill("prefix_aware", [pv("idle", prefill_s=cold), holder], 0).name == "holder"


def test_prefix_aware_tie_goes_to_the_bigger_hit():
    tie = [pv("a", 0, queued_s=0.1, prefill_s=1.0), pv("b", 100, queued_s=0.2, prefill_s=0.95)]
    assert pick_prefill("prefix_aware", tie, 0).name == "b"


def test_prefix_aware_spreads_new_prefixes_to_the_fewest_requests():
    busy = [pv("a", requests=2, prefill_s=1.0), pv("b", requests=1, prefill_s=1.0),
            pv("c", requests=3, prefill_s=1.0)]
    assert pick_prefill("prefix_aware", busy, 0).name == "b"


def test_decode_by_kv_tokens_then_running():
    ds = [DecodeView("d0", 5_000, 1), DecodeView("d1", 2_000, 9), DecodeView("d2", 2_000, 3)]
    assert pick_decode("least_load", ds, 0).name == "d2"
    assert pick_decode("round_robin", ds, 1).name == "d1"


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="one of round_robin, least_load, prefix_aware"):
        pick_prefill("random", P, 0)


def test_ties_go_round_robin_by_turn():
    # Every cache looks empty (a request right behind another, its KV events not in yet).
    idle = [pv(n, prefill_s=1.0) for n in ("a", "b", "c")]
    assert [pick_prefill("prefix_aware", idle, t).name for t in range(4)] == ["a", "b", "c", "a"]
    assert [pick_prefill("least_load", idle, t).name for t in range(3)] == ["a", "b", "c"]
    ds = [DecodeView(n, 0, 0) for n in ("d0", "d1")]
    assert [pick_decode("least_load", ds, t).name for t in range(3)] == ["d0", "d1", "d0"]


def test_prefix_aware_prefers_the_d_holding_the_prompt_between_equal_loads():
    ds = [DecodeView("d0", 0, 0, matched_tokens=0), DecodeView("d1", 0, 0, matched_tokens=512),
          DecodeView("d2", 100, 0, matched_tokens=1024)]
    assert pick_decode("prefix_aware", ds, 0).name == "d1"  # d2 holds more but is loaded
    assert pick_decode("least_load", ds, 0).name == "d0"
