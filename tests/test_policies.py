"""Routing choices (router/policies.py) on hand-made instance views."""

from __future__ import annotations

import pytest

from pdcluster.router.policies import DecodeView, PrefillView, pick_decode, pick_prefill

P = [PrefillView("p0", matched_tokens=0, queued_tokens=0), PrefillView("p1", matched_tokens=900, queued_tokens=500),
     PrefillView("p2", matched_tokens=0, queued_tokens=2_000)]


def test_round_robin_ignores_cache_and_load():
    assert [pick_prefill("round_robin", P, 1_000, t).name for t in range(4)] == ["p0", "p1", "p2", "p0"]


def test_least_load_picks_the_shortest_queue():
    assert pick_prefill("least_load", P, 1_000, 0).name == "p0"


def test_prefix_aware_trades_cached_prefix_against_queue():
    # p1: 2 x 100 to compute + 500 queued = 700 < p0's 2 x 1,000: the cache wins.
    assert pick_prefill("prefix_aware", P, 1_000, 0).name == "p1"
    # A queue on p1 longer than twice what the prefix saves (2 x 900): the idle P wins.
    busy = [P[0], PrefillView("p1", matched_tokens=900, queued_tokens=1_801)]
    assert pick_prefill("prefix_aware", busy, 1_000, 0).name == "p0"
    # Up to that, the request waits behind p1's queue and hits.
    sticky = [P[0], PrefillView("p1", matched_tokens=900, queued_tokens=1_799)]
    assert pick_prefill("prefix_aware", sticky, 1_000, 0).name == "p1"


def test_prefix_aware_tie_goes_to_the_bigger_hit():
    tie = [PrefillView("a", 0, 100), PrefillView("b", 100, 200)]
    assert pick_prefill("prefix_aware", tie, 1_000, 0).name == "b"


def test_prefix_aware_spreads_new_prefixes_to_the_fewest_requests():
    busy = [PrefillView("a", 0, 0, queued_requests=2), PrefillView("b", 0, 0, queued_requests=1),
            PrefillView("c", 0, 0, queued_requests=3)]
    assert pick_prefill("prefix_aware", busy, 1_000, 0).name == "b"


def test_decode_by_kv_tokens_then_running():
    ds = [DecodeView("d0", 5_000, 1), DecodeView("d1", 2_000, 9), DecodeView("d2", 2_000, 3)]
    assert pick_decode("least_load", ds, 0).name == "d2"
    assert pick_decode("round_robin", ds, 1).name == "d1"


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="one of round_robin, least_load, prefix_aware"):
        pick_prefill("random", P, 10, 0)


def test_ties_go_round_robin_by_turn():
    # Every cache looks empty (a request right behind another, its KV events not in yet).
    idle = [PrefillView(n, 0, 0) for n in ("a", "b", "c")]
    assert [pick_prefill("prefix_aware", idle, 1_000, t).name for t in range(4)] == ["a", "b", "c", "a"]
    assert [pick_prefill("least_load", idle, 1_000, t).name for t in range(3)] == ["a", "b", "c"]
    ds = [DecodeView(n, 0, 0) for n in ("d0", "d1")]
    assert [pick_decode("least_load", ds, t).name for t in range(3)] == ["d0", "d1", "d0"]


def test_prefix_aware_prefers_the_d_holding_the_prompt_between_equal_loads():
    ds = [DecodeView("d0", 0, 0, matched_tokens=0), DecodeView("d1", 0, 0, matched_tokens=512),
          DecodeView("d2", 100, 0, matched_tokens=1024)]
    assert pick_decode("prefix_aware", ds, 0).name == "d1"  # d2 holds more but is loaded
    assert pick_decode("least_load", ds, 0).name == "d0"
