"""How long a prefill takes on P: the unit `prefix_aware` weighs P's queues and a request's own
work in (router/policies.py), so that a warm 12K-token remainder over 118K of history is not
taken for a tenth of a cold 131K prefill (attention over the history is most of a long prompt's
work; docs/sim.md: 1.09 s vs 8.43 s on the DeepSeek-V4 parameters).

- `ModelledCost`: the simulated engine's own cost model (cluster/sim/cost.py), the steps its
  scheduler will run: exact for that engine, by construction.
- `FittedCost`: real engines. A least-squares fit of the prefill times P's engine reported
  (vLLM's scheduled and first-token timestamps, on P's own clock) over its recent requests,
      seconds = a * new + b * new * (cached + new / 2),
  per-token work (weights) plus attention (each new token over the history before it and over
  half the new ones). Both coefficients stay non-negative. Until the prefills seen span two
  sizes, the attention term is unknown and the cost is linear in new tokens: the token rule
  this replaces, scaled. A prefill that shared its steps with others is longer than alone; under
  load the fit sees that too, which is what the queue will cost.
  Of the cached tokens, those a host KV tier gives are not free: P loads them (docs/kv_tiers.md).
  A third coefficient prices each, `c * tier`, fitted to what the prefills with a tier hit took
  beyond what the first two terms say (a, b are fitted to the others alone): on a GPU, the PCIe
  copy of their blocks; on a CPU engine, a copy within host memory. Those P reads from a peer P's
  tier (the pool, `router.p_pool`) cross the network: a fourth, `d * pool`, fitted the same way
  to the prefills with a pool read (beyond a, b and c); until one is seen, priced as a tier token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Before the first observation: any positive scale does (every figure compared is in it).
_PRIOR_S_PER_TOKEN = 1e-4
_WINDOW = 256  # prefills kept for the fit: recent enough to follow the engine, enough to fit two terms


class PrefillCost(Protocol):
    def seconds(self, cached_tokens: int, prompt_tokens: int, tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        """Predicted time P takes to prefill a prompt of which `cached_tokens` are in its cache,
        `tier_tokens` of them in its host KV tier and `pool_tokens` in a peer P's (loaded, not
        computed)."""

    def observe(self, cached_tokens: int, prompt_tokens: int, seconds: float, tier_tokens: int = 0,
                pool_tokens: int = 0) -> None:
        """A prefill P finished, as its engine timed it (a model that learns nothing ignores it)."""

    def taken_s(self, cached_tokens: int, prompt_tokens: int, queued_tokens: int, queued_s: float,
                tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        """Predicted time from P's first step of the prompt to its last, behind `queued_tokens`
        to compute (predicted at `queued_s`) that P took in before it."""


class StepTimes(Protocol):
    block_size: int

    def prefill_s(self, new_tokens: int, cached_tokens: int, budget: int) -> float:
        """A prefill's time in chunks of `budget` tokens (cluster/sim/cost.py's CostModel)."""

    @property
    def block_bytes(self) -> int:
        """One block of every full and compressed component."""

    def transfer_s(self, nbytes: int) -> float:
        """The modelled network's time for these bytes."""


@dataclass(frozen=True)
class ModelledCost:
    model: StepTimes
    budget: int  # P's max_num_batched_tokens: its chunked prefill's step size
    # (cached, prompt) -> seconds: a pick asks it of every P, mostly for the same few shapes
    _memo: dict[tuple[int, int], float] = field(default_factory=dict, compare=False, repr=False)

    def seconds(self, cached_tokens: int, prompt_tokens: int, tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        # The simulated engine's tier loads are not in this model (docs/kv_tiers.md); a read of a
        # peer's tier is its blocks over the modelled network, as the engine waits it out.
        key = (cached_tokens, prompt_tokens)
        if key not in self._memo:
            new = prompt_tokens - min(cached_tokens, prompt_tokens)
            self._memo[key] = self.model.prefill_s(new, prompt_tokens - new, self.budget) if new else 0.0
        if pool_tokens:
            m = self.model
            return self._memo[key] + m.transfer_s(-(-pool_tokens // m.block_size) * m.block_bytes)
        return self._memo[key]

    def observe(self, cached_tokens: int, prompt_tokens: int, seconds: float, tier_tokens: int = 0,
                pool_tokens: int = 0) -> None:
        pass

    def taken_s(self, cached_tokens: int, prompt_tokens: int, queued_tokens: int, queued_s: float,
                tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        new = prompt_tokens - min(cached_tokens, prompt_tokens)
        return shared_steps_s(queued_tokens, queued_s, new, self.seconds(cached_tokens, prompt_tokens), self.budget)


def shared_steps_s(ahead_tokens: int, ahead_s: float, own_tokens: int, own_s: float, budget: int) -> float:
    """The steps a prompt of `own_tokens` (`own_s` alone) takes on a P that fills `budget` tokens a
    step in order, behind `ahead_tokens` queued (`ahead_s` alone): its first step holds the end of
    the queued work. A P with more than a step's work queued is a P under load: the requests after
    this one are taken to fill its last step as those before fill its first (at its own rate:
    they are not known yet). An idle P runs it alone."""
    if own_tokens <= 0:
        return 0.0
    if ahead_tokens <= 0:
        return own_s
    before = ahead_tokens % budget  # the queued work ends inside the prompt's first step
    after = -(ahead_tokens + own_tokens) % budget if ahead_tokens > budget else 0  # its last step's room
    return before * ahead_s / ahead_tokens + own_s + after * own_s / own_tokens


def _features(cached_tokens: int, prompt_tokens: int) -> tuple[float, float]:
    new = prompt_tokens - min(cached_tokens, prompt_tokens)
    return float(new), new * (prompt_tokens - new + new / 2)


class FittedCost:
    def __init__(self, window: int = _WINDOW):
        # (new tokens, attention pairs, seconds) of the last `window` prefills P's engines reported.
        self._seen: deque[tuple[float, float, float]] = deque(maxlen=window)
        # (new tokens, attention pairs, tier tokens, seconds) of those with a host-tier hit.
        self._tier_seen: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        # (new tokens, attention pairs, tier tokens, pool tokens, seconds) of those with a pool read.
        self._pool_seen: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)
        self._fitted = (_PRIOR_S_PER_TOKEN, 0.0, 0.0, 0.0)  # (a, b, c, d), as of the last fit
        self._stale = False  # observations since the last fit

    @property
    def per_token_s(self) -> float:
        return self._coefficients()[0]

    @property
    def per_pair_s(self) -> float:
        return self._coefficients()[1]

    @property
    def per_tier_token_s(self) -> float:
        return self._coefficients()[2]

    @property
    def per_pool_token_s(self) -> float:
        return self._coefficients()[3]

    def seconds(self, cached_tokens: int, prompt_tokens: int, tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        a, b, c, d = self._coefficients()
        new, pairs = _features(cached_tokens, prompt_tokens)
        return a * new + b * pairs + c * tier_tokens + d * pool_tokens

    def taken_s(self, cached_tokens: int, prompt_tokens: int, queued_tokens: int, queued_s: float,
                tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        return self.seconds(cached_tokens, prompt_tokens, tier_tokens, pool_tokens)  # fitted to such times: any sharing is in it

    def observe(self, cached_tokens: int, prompt_tokens: int, seconds: float, tier_tokens: int = 0,
                pool_tokens: int = 0) -> None:
        new, pairs = _features(cached_tokens, prompt_tokens)
        if new > 0 and seconds > 0:  # a full hit computes nothing: it says nothing of the cost
            if pool_tokens > 0:
                self._pool_seen.append((new, pairs, float(tier_tokens), float(pool_tokens), seconds))
            elif tier_tokens > 0:
                self._tier_seen.append((new, pairs, float(tier_tokens), seconds))
            else:
                self._seen.append((new, pairs, seconds))
            self._stale = True

    def _coefficients(self) -> tuple[float, float, float, float]:
        if self._stale:  # fitted when asked, not per observation: picks are rarer than reports
            a, b = _nonnegative_fit(self._seen) if self._seen else self._fitted[:2]
            # Least squares of what the tier hits took beyond the first two terms, per tier token.
            zz = sum(z * z for _, _, z, _ in self._tier_seen)
            zr = sum(z * (t - a * x - b * y) for x, y, z, t in self._tier_seen)
            c = max(zr / zz, 0.0) if zz else 0.0
            # ... and the pool reads beyond the first three, per pool token; a tier token's until seen.
            ww = sum(w * w for *_, w, _ in self._pool_seen)
            wr = sum(w * (t - a * x - b * y - c * z) for x, y, z, w, t in self._pool_seen)
            self._fitted, self._stale = (a, b, c, max(wr / ww, 0.0) if ww else c), False
        return self._fitted


def _nonnegative_fit(seen: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of t = a x + b y with a, b >= 0: the unconstrained solution if it is
    non-negative, else the better of the two with one coefficient at 0."""
    xx = sum(x * x for x, _, _ in seen)
    yy = sum(y * y for _, y, _ in seen)
    xy = sum(x * y for x, y, _ in seen)
    xt = sum(x * t for x, _, t in seen)
    yt = sum(y * t for _, y, t in seen)
    det = xx * yy - xy * xy
    # One size seen (det ~ 0): the two columns are proportional, the split between them unknown.
    if det <= 1e-9 * xx * yy:
        return xt / xx, 0.0
    a, b = (xt * yy - yt * xy) / det, (yt * xx - xt * xy) / det
    if a >= 0 and b >= 0:
        return a, b
    return min(((xt / xx, 0.0), (0.0, yt / yy)),
               key=lambda ab: sum((t - ab[0] * x - ab[1] * y) ** 2 for x, y, t in seen))
