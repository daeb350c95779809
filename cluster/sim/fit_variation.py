"""How much a run's step times vary around a fitted model (`pdc sim fit`, after the means):
the parameter file's `variation` (cluster/sim/variation.py), measured.

- D: every step seen as two consecutive tokens of a request (fit.py's gaps), as
  r = log(observed / modelled). Per request, in order, the series' autocovariance at lags
  2..`MAX_LAG` (lag 1 left out: a token the router stamps late makes one gap long and the
  next short) is what the steps share: the drift, whose covariance at lag L is
  drift_sd^2 * (1 - L / drift_steps) for windows of drift_steps steps; least squares over
  the lags, for each window length, gives both. What the series' variance has beyond the
  drift is each step's own (`decode_sd`; on vLLM it holds the router's stamping jitter too,
  as the ITL a client sees does).
- P: every prefill that ran alone, r over its steps; a sum of k steps varies sqrt(k) times
  less than one, so each r counts sqrt(k) times.

Real runs' residuals have heavy tails (a step that waited for the host; two tokens stamped
together): spreads are read from the 10th and 90th percentiles (as a normal's would be), and
residuals beyond `CLIP` of those spreads are clipped before the covariances. On the tiny
model's P1D1 that spread is 0.22 where the standard deviation is 0.34 and the median absolute
deviation reads 0.19: the body of the distribution, not the last few percent. The means stay
the fit's: the file's factors have mean 1.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.cluster.sim.fit import _alone_prefills, _decode_steps, _prefill_steps, prefill_chunk, run_spec, served
from pdcluster.router.run_store import Run

MAX_LAG = 32  # lags the drift is read over
MIN_GAPS = 200  # D steps below which a run says too little of its variation (pdc sim fit keeps the base's)
MAX_WINDOW = 1024  # the longest drift window considered, in steps
CLIP = 4.0  # robust spreads beyond which a residual is clipped
_P10_P90 = 2.5631  # a normal's 90th minus its 10th percentile, in standard deviations


@dataclass(frozen=True)
class MeasuredVariation:
    decode_sd: float
    drift_sd: float
    drift_steps: int
    prefill_sd: float
    decode_gaps: int  # D steps it was read over
    prefills: int  # alone prefills

    def numbers(self) -> dict[str, float]:
        """As parameter-file numbers ("variation.decode_sd": ...)."""
        return {f"variation.{k}": v for k, v in (("decode_sd", self.decode_sd), ("drift_sd", self.drift_sd),
                                                  ("drift_steps", self.drift_steps), ("prefill_sd", self.prefill_sd))}


def _robust_sd(r: np.ndarray) -> float:
    return float(np.subtract(*np.percentile(r, [90, 10])) / _P10_P90) if len(r) else 0.0


def drift_of(series: list[np.ndarray], max_lag: int = MAX_LAG) -> tuple[float, int, np.ndarray]:
    """(drift variance, window in steps, the autocovariances at lags 0..max_lag) of centred
    per-request series."""
    cov = np.zeros(max_lag + 1)
    for lag in range(max_lag + 1):
        pairs = [(s[:len(s) - lag], s[lag:]) for s in series if len(s) > lag]
        if pairs:
            cov[lag] = float(np.mean(np.concatenate([a * b for a, b in pairs])))
    lags = np.arange(2, max_lag + 1)
    c = cov[2:]
    best = (np.inf, 0.0, 1)
    for window in range(2, MAX_WINDOW + 1):
        shape = np.maximum(0.0, 1.0 - lags / window)
        if not shape.any():
            continue
        var = max(0.0, float(c @ shape / (shape @ shape)))
        sse = float(((c - var * shape) ** 2).sum())
        if sse < best[0] - 1e-15:
            best = (sse, var, window)
    return best[1], best[2], cov


def measure(run: Run, params: SimParams) -> MeasuredVariation:
    """The variation of the run's steps around `params` (the file fitted to it)."""
    spec = run_spec(run)
    cost = CostModel(params, spec.role_engine("decode").block_size)
    records = served(run)
    by_request: dict[str, list[float]] = defaultdict(list)
    for g in _decode_steps(records, spec.role_engine("decode").kind == "sim"):
        by_request[g.request].append(np.log(g.seconds / cost.decode_step_s(g.contexts)))
    flat = np.concatenate([np.asarray(v) for v in by_request.values()]) if by_request else np.zeros(0)
    sd = _robust_sd(flat)
    centre = float(np.median(flat)) if len(flat) else 0.0
    series = [np.clip(np.asarray(v) - centre, -CLIP * sd, CLIP * sd) for v in by_request.values()]
    drift_var, window, cov = drift_of(series) if len(flat) else (0.0, 1, np.zeros(1))
    total_var = sd ** 2
    drift_var = min(drift_var, total_var)

    chunk = prefill_chunk(spec)
    scaled = []
    for r in _alone_prefills(records):
        steps = _prefill_steps(cost, r.prompt_tokens - r.p_cached_tokens, r.p_cached_tokens, chunk)
        modelled = sum(float(cost.step_seconds(w)[0]) for w in steps)
        observed = (r.events["p_done"] - r.events["p_scheduled"]) / 1e9
        scaled.append(np.log(observed / modelled) * np.sqrt(len(steps)))
    return MeasuredVariation(decode_sd=float(np.sqrt(total_var - drift_var)), drift_sd=float(np.sqrt(drift_var)),
                             drift_steps=window if drift_var > 0 else 1, prefill_sd=_robust_sd(np.asarray(scaled)),
                             decode_gaps=len(flat), prefills=len(scaled))
