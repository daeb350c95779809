"""Whether D prefills a request itself (conditional disaggregation, as NVIDIA Dynamo's
disaggregated router decides it): no P, no transfer, D's engine computes the remainder its
own prefix cache does not hold, in its normal steps beside the requests it decodes.

A pure function over what the router knows when it routes, so every threshold is unit-tested
without engines; router/routing.py calls it on the D the policy picked.

The rule, in order (`LocalPrefillSpec`, spec field `router.local_prefill`):
- `policy: never`: always P (today's path, exactly);
- `policy: always`: always D, whatever D holds or does (no disaggregation: with no P at all, the
  virtual clock's baseline for `pdc plan`);
- no P is up (each dead, restarting or cut off): D, whatever the remainder ("p_down"), as the
  alternative is a 503;
- D's prefix index is stale (it lost events, router/kv_events.py): its hit is not known, P;
- the remainder on D (prompt minus what D's events confirmed) is over `max_tokens` and P is
  not busy: P ("long_remainder"). P is busy when the P the policy picked has at least
  `p_busy_s` of predicted prefill queued (router/prefill_cost.py; Dynamo's
  max_prefill_queue_size, in time): then D prefills even a long remainder ("p_busy");
- D already runs `max_in_flight` local prefills: P ("d_busy"), so D's decode steps carry
  at most that many prompt chunks (each slows every request D decodes in that step);
- else D ("short_remainder" or "p_busy").

With the pool (`pool: true`, docs/kv_tiers.md "The pool"), what D holds of the prompt is the longer
of its own hit and the run of the prompt's first blocks a P's host tier holds: D reads that run
over the KV plane and computes only the rest, so a family D lost but a P's tier kept is a short
remainder too. The decision names the tokens it expects from the pool (`pool_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdcluster.proto.router_spec import LocalPrefillSpec

Reason = Literal["never", "stale_index", "long_remainder", "d_busy", "short_remainder", "p_busy", "always", "p_down"]
LOCAL_REASONS: frozenset[str] = frozenset({"short_remainder", "p_busy", "always", "p_down"})

@dataclass(frozen=True)
class LocalView:
    """What the router knows of the request and the D (and P) it picked."""

    prompt_tokens: int
    d_matched_tokens: int  # the prompt's prefix D's KV events confirmed
    d_index_stale: bool  # D's prefix index lost events: it may miss what D holds
    d_local_in_flight: int  # local prefills D runs now (the router's count)
    p_queued_s: float  # predicted prefill time queued on the P the policy picked
    pool_tokens: int = 0  # the longest run of the prompt's first blocks a P's host tier holds (the pool)
    p_up: bool = True  # some P is up to take the prefill


@dataclass(frozen=True)
class LocalDecision:
    local: bool
    reason: Reason
    remainder_tokens: int  # prompt tokens D would compute
    pool_tokens: int = 0  # D prefills it reading this many tokens from a P's tier first (0: none)


def decide(spec: LocalPrefillSpec, view: LocalView) -> LocalDecision:
    pool = view.pool_tokens if spec.pool and view.pool_tokens > view.d_matched_tokens else 0
    remainder = view.prompt_tokens - min(max(view.d_matched_tokens, pool), view.prompt_tokens)
    if spec.policy == "never":
        return LocalDecision(False, "never", remainder)
    if spec.policy == "always":
        return LocalDecision(True, "always", remainder, pool)
    if not view.p_up:
        return LocalDecision(True, "p_down", remainder, pool)
    if view.d_index_stale:
        return LocalDecision(False, "stale_index", remainder)
    p_busy = spec.p_busy_s is not None and view.p_queued_s >= spec.p_busy_s
    if remainder > spec.max_tokens and not p_busy:
        return LocalDecision(False, "long_remainder", remainder)
    if view.d_local_in_flight >= spec.max_in_flight:
        return LocalDecision(False, "d_busy", remainder)
    return LocalDecision(True, "short_remainder" if remainder <= spec.max_tokens else "p_busy", remainder, pool)
