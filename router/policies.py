"""How the router picks P and D for a request (issue 6: `round_robin`, `least_load`, `prefix_aware`).

Pure functions over what the router knows of each instance, so the choices are
unit-tested without engines; router/routing.py feeds them.

- round_robin: the next instance in turn, whatever it holds or does;
- least_load: P with the fewest prefill tokens queued (ties: fewer requests);
- prefix_aware: P minimising what the request costs there, in predicted time
  (router/prefill_cost.py): the prefill time of what it queues behind, plus the
  time of its own prefill there (over what the P holds or is promised,
  router/pending_blocks.py), counted twice: once as this request's own wait,
  once as the P time it takes from every request that will queue behind it.
  A P holding a prompt's prefix wins unless its queue is longer than another's
  by more than twice what the prefix saves there (cold minus warm prefill
  time); so a burst of one new family queues behind the first of it on one P
  (and hits) instead of prefilling it cold on every idle P, and the family is
  copied to a second P only once the holder's queue exceeds the idle P's by
  two cold-minus-warm prefills (it arrives faster than one P prefills it).
  Time, not tokens: a warm remainder over a long history costs its attention
  over that history, far more than its share of tokens. vllm-router's `cache_aware` weighs hit ratio against
  load the same way, with a threshold instead of one cost. With router.p_pool, what a
  P holds may be a run it would read from a peer's host tier (PrefillView.pool_from);
  of equal costs, the P holding the prefix itself wins. On a tie (a prefix no P
  holds, idle instances) the P with fewer requests wins, then the next in
  turn, so new prefix families spread over the instances instead of piling
  onto the first. (Not the P holding the fewest blocks: vLLM publishes a
  reset's AllBlocksCleared only at the engine's next step, so an idle
  instance's index can look full long after its cache was emptied.)
D is picked by load in every policy but round_robin: the KV tokens its requests
hold (prompt + max_tokens each), then running requests; prefix_aware then prefers
the D that holds more of the prompt (less to transfer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.proto.router_spec import POLICIES, Policy


@dataclass(frozen=True)
class PrefillView:
    name: str
    matched_tokens: int  # the prompt's cached prefix on this P (its prefix index)
    queued_tokens: int  # prefill tokens waiting or running on it
    queued_requests: int = 0
    queued_s: float = 0.0  # their predicted prefill time (router/prefill_cost.py)
    prefill_s: float = 0.0  # this request's predicted prefill time on it (its hit there considered)
    tier_tokens: int = 0  # of matched_tokens, those in its host KV tier (loaded, not computed)
    # It reads the prompt's first `matched_tokens` from this peer P's host tier (router.p_pool), of
    # which `pool_read_tokens` past what it holds itself. None: no read.
    pool_from: str | None = None
    pool_read_tokens: int = 0


@dataclass(frozen=True)
class DecodeView:
    name: str
    kv_tokens: int  # KV its requests hold or will: prompt + max_tokens each
    running: int
    matched_tokens: int = 0  # the prompt's cached prefix on this D (what it need not receive)


def pick_prefill(policy: Policy, candidates: Sequence[PrefillView], turn: int) -> PrefillView:
    """`turn`: the request's sequence number (round_robin's position)."""
    assert candidates, "no prefill instance to pick from"
    if policy == "round_robin":
        return candidates[turn % len(candidates)]
    if policy == "least_load":
        return min(candidates, key=lambda c: (c.queued_tokens, c.queued_requests, _rotated(candidates, c, turn)))
    if policy == "prefix_aware":
        return min(candidates, key=lambda c: (2 * c.prefill_s + c.queued_s, -c.matched_tokens,
                                              c.pool_from is not None,  # of equals, the one that holds it
                                              c.queued_requests, _rotated(candidates, c, turn)))
    raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")


def _rotated(candidates: Sequence[PrefillView] | Sequence[DecodeView], c, turn: int) -> int:
    """The last tie-breaker: positions rotated by the turn, so ties go round robin. (A P's
    KV events reach the router a little after its reply: a request right behind another
    can see every cache still empty, and must not go to the same P by name.)"""
    return (candidates.index(c) - turn) % len(candidates)


def pick_decode(policy: Policy, candidates: Sequence[DecodeView], turn: int) -> DecodeView:
    assert candidates, "no decode instance to pick from"
    if policy == "round_robin":
        return candidates[turn % len(candidates)]
    if policy == "least_load":
        return min(candidates, key=lambda c: (c.kv_tokens, c.running, _rotated(candidates, c, turn)))
    if policy == "prefix_aware":  # by load; between equally loaded D, the one holding more of the prompt
        return min(candidates, key=lambda c: (c.kv_tokens, c.running, -c.matched_tokens,
                                              _rotated(candidates, c, turn)))
    raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
