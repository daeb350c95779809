"""Fit a parameter file's free numbers to a run's timelines (`pdc sim fit`, issue 18 item 3).

What a run directory (router/timeline.py: meta.json with the cluster spec, requests.jsonl with
every request's events) says of its engines' step times:
- a prefill P ran alone (no other request's [p_scheduled, p_done] on that P overlaps it) took
  p_done - p_scheduled for its prompt past P's hit, in steps of the spec's token budget: the
  cost model's steps of those chunks (as the scheduler makes them, scheduler_core.py);
- consecutive tokens of a request on D are one D step apart, and that step decoded every
  request D was running then: those whose tokens span it, each over its context (prompt and
  the tokens it had). With the simulated engine a step's tokens share one time; with vLLM the
  router stamps them as they come, a little apart, so a request counts as in the step if its
  tokens reach within `SLACK` of the step's end. Up to `SPAN` consecutive steps of one request
  with the same requests running are one observation, their summed time: a token the router
  stamps late makes one gap long and the next short (on this 2-core machine, +-40% at the
  10th and 90th percentiles), and a fit on relative residuals of single gaps would come out
  ~15% short of their mean; over a span, only its two ends carry that jitter.
Both are the cost model's `StepWork`, fixed by the model's shape, times the free numbers
(CostModel.step_seconds): the fit minimises the residuals of every observation, a prefill's
relative to its time (they range from milliseconds to seconds), a D span's in steps of a typical
D step (relative ones weigh a noisy span's fast steps more, and the fit came out below the mean)
(Levenberg-Marquardt on the logarithms, so each number stays positive; efficiencies at most 1),
with a weak pull towards the base file's values so that a number the run says nothing about
stays where it was (and is reported as such). Real runs have outliers (a step that waited for
the host, an engine's first calls): after a first fit, observations off by more than three times
the median residual (and 20%) are dropped, and the fit is run again from there (`FitResult.dropped`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdcluster.cluster.sim.cost import CostModel, SimParams, StepWork
from pdcluster.proto.spec import ClusterSpec, parse_spec
from pdcluster.router.run_store import Run
from pdcluster.router.timeline import RequestRecord

# The numbers docs/sim.md names as fitted: efficiencies and per-step overheads.
FREE: tuple[str, ...] = ("efficiency.gemm", "efficiency.attention", "efficiency.attention_history",
                         "efficiency.prefill_kv_read", "efficiency.memory_bandwidth", "overheads.prefill_step_s",
                         "overheads.decode_step_s", "overheads.decode_request_s", "overheads.hidden_device_s")
PRIOR_WEIGHT = 1e-3  # the pull towards the base file, per unit of log (a residual of 0.1% per e-fold)
SLACK = 0.25  # vLLM runs: a request is in a step if its tokens reach within this share of the step's end
SPAN = 8  # consecutive D steps of one request (the same requests running) observed as one
MAX_PREFILLS, MAX_DECODE_SPANS = 600, 600  # observations kept (evenly spaced): the fit's time


class FitError(ValueError):
    """The run cannot be fitted; the message says why."""


@dataclass(frozen=True)
class Observations:
    """Observed step times and the work of each: prefills (each the sum of its chunk steps) and D steps."""

    prefill_steps: StepWork  # every kept prefill's chunk steps, stacked
    prefill_of: np.ndarray  # per chunk step, which prefill it is of
    prefill_s: np.ndarray
    decode_steps: StepWork  # every kept span's steps, stacked
    decode_of: np.ndarray  # per step, which span it is of
    decode_s: np.ndarray  # per span: its steps' summed time
    prefill_requests: int  # prefills seen in the run (the kept ones ran alone)
    decode_gaps: int  # consecutive-token gaps seen (the kept ones evenly spaced)

    def __len__(self) -> int:
        return len(self.prefill_s) + len(self.decode_s)


def _spaced(items: list, most: int) -> list:
    if len(items) <= most:
        return items
    step = len(items) / most
    return [items[int(i * step)] for i in range(most)]


def run_spec(run: Run) -> ClusterSpec:
    """The spec a run was made with (its secrets are masked in meta.json: left out)."""
    return parse_spec({k: v for k, v in run.meta.spec.items() if k != "auth"}, f"{run.meta.run_id} meta.json")


def observations(run: Run, cost: CostModel, sim_clock: bool | None = None) -> Observations:
    """The run's alone prefills and D steps, as StepWork under `cost`'s model shape. `sim_clock`:
    tokens of one step share one time (the simulated engine); None: from the run's spec."""
    spec = run_spec(run)
    if sim_clock is None:
        sim_clock = spec.role_engine("decode").kind == "sim"
    records = served(run)
    if not records:
        raise FitError(f"run {run.meta.run_id} has no successful request")
    chunk = prefill_chunk(spec)
    prefills = _alone_prefills(records)
    kept = _spaced(prefills, MAX_PREFILLS)
    p_works = [_prefill_steps(cost, r.prompt_tokens - r.p_cached_tokens, r.p_cached_tokens, chunk) for r in kept]
    p_s = np.array([(r.events["p_done"] - r.events["p_scheduled"]) / 1e9 for r in kept])
    gaps = _decode_steps(records, sim_clock)
    spans = _spaced(_spans(gaps), MAX_DECODE_SPANS)
    if not kept or not spans:
        raise FitError(f"run {run.meta.run_id}: {len(kept)} prefills ran alone on their P, {len(spans)} D steps "
                       f"seen between two tokens of a request: the fit needs both (a run with some idle time "
                       f"on P, and outputs of two tokens or more)")
    d_s = np.array([sum(g.seconds for g in span) for span in spans])
    p_of = np.concatenate([np.full(len(w), i) for i, w in enumerate(p_works)])
    d_of = np.concatenate([np.full(len(span), i) for i, span in enumerate(spans)])
    return Observations(StepWork.stack([w for ws in p_works for w in ws]), p_of, p_s,
                        StepWork.stack([cost.step_work((), g.contexts) for span in spans for g in span]), d_of, d_s,
                        len(prefills), len(gaps))


def served(run: Run) -> list[RequestRecord]:
    """The run's requests that arrived and succeeded: the ones whose steps say something."""
    return [r for r in run.records if r.error is None and "arrival" in r.events]


def prefill_chunk(spec: ClusterSpec) -> int:
    """The most new tokens one of P's steps computes for a prompt (the budget, or vLLM's per-request cap)."""
    p_eng = spec.role_engine("prefill")
    threshold = int(p_eng.extra.get("long_prefill_token_threshold", 0))
    return min(p_eng.max_num_batched_tokens, threshold) if threshold else p_eng.max_num_batched_tokens


def _alone_prefills(records: list[RequestRecord]) -> list[RequestRecord]:
    by_p: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        ev = r.events
        if r.prefill_instance and not r.local_prefill and "p_scheduled" in ev and ev.get("p_done", 0) > ev["p_scheduled"]:
            by_p[r.prefill_instance].append(r)
    alone = []
    for reqs in by_p.values():
        reqs.sort(key=lambda r: r.events["p_scheduled"])
        for i, r in enumerate(reqs):
            start, end = r.events["p_scheduled"], r.events["p_done"]
            before = i > 0 and max(q.events["p_done"] for q in reqs[:i]) > start
            after = i + 1 < len(reqs) and reqs[i + 1].events["p_scheduled"] < end
            if not before and not after and r.prompt_tokens > r.p_cached_tokens:
                alone.append(r)
    return sorted(alone, key=lambda r: r.events["p_scheduled"])


def _prefill_steps(cost: CostModel, new: int, history: int, chunk: int) -> list[StepWork]:
    """A prompt's steps alone on P, as the scheduler makes them (a single token over a cached
    context is decode-shaped)."""
    works = []
    while new > 0:
        n = min(new, chunk)
        works.append(cost.step_work((), [history + 1]) if n == 1 and history else cost.step_work([(n, history)], ()))
        history, new = history + n, new - n
    return works


@dataclass(frozen=True)
class _Gap:
    """One D step, seen as two consecutive tokens of one request."""

    request: str
    running: frozenset[str]  # the requests D ran in it
    contexts: list[int]  # theirs
    seconds: float


def _spans(gaps: list[_Gap]) -> list[list[_Gap]]:
    """Runs of at most SPAN consecutive gaps of one request with the same requests running."""
    spans: list[list[_Gap]] = []
    for g in gaps:
        last = spans[-1] if spans else None
        if last and len(last) < SPAN and last[-1].request == g.request and last[-1].running == g.running:
            last.append(g)
        else:
            spans.append([g])
    return spans


def _decode_steps(records: list[RequestRecord], sim_clock: bool) -> list[_Gap]:
    """Per D step seen as one request's consecutive tokens (in each request's order)."""
    by_d: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.decode_instance and len(r.token_ns) >= 2 and not r.local_prefill:
            by_d[r.decode_instance].append(r)
    out = []
    for reqs in by_d.values():
        for r in reqs:
            for k in range(1, len(r.token_ns)):
                t0, t1 = r.token_ns[k - 1], r.token_ns[k]
                if t1 <= t0:
                    continue
                slack = 0 if sim_clock else int(SLACK * (t1 - t0))
                contexts, running = [], []
                for q in reqs:
                    ts = q.token_ns
                    if ts[0] > t1 + slack or ts[-1] <= t0 + slack:
                        continue  # not decoding then
                    # Its token of this step: the first after t0 (+ slack); its context, what came before.
                    j = bisect_right(ts, t0 + slack) if not sim_clock else bisect_left(ts, t1)
                    if j < len(ts) and ts[j] <= t1 + slack:
                        contexts.append(q.prompt_tokens + j)
                        running.append(q.request_id)
                if contexts:
                    out.append(_Gap(r.request_id, frozenset(running), contexts, (t1 - t0) / 1e9))
    return out


# ---- the fit ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FittedNumber:
    name: str  # "efficiency.gemm"
    base: float
    value: float
    determined: bool  # the run's steps depend on it (else it stayed near the base value)


@dataclass
class FitResult:
    params: SimParams
    numbers: list[FittedNumber]
    prefill_residuals: np.ndarray  # (model - observed) / observed, per kept prefill
    decode_residuals: np.ndarray
    observations: Observations
    base_residuals: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: (np.zeros(0), np.zeros(0)))
    dropped: int = 0  # outliers left out of the second fit


def _get(params: SimParams, name: str) -> float:
    section, key = name.split(".")
    return float(getattr(getattr(params, section), key))


def with_numbers(params: SimParams, values: dict[str, float]) -> SimParams:
    """params with these dotted numbers replaced (validated as a file would be)."""
    data = params.model_dump()
    for name, v in values.items():
        section, key = name.split(".")
        data[section][key] = v
    return SimParams.parse(data, f"{params.name} (fitted)")


def residuals(params: SimParams, block_size: int, obs: Observations) -> tuple[np.ndarray, np.ndarray]:
    cost = CostModel(params, block_size)
    p = np.bincount(obs.prefill_of, weights=cost.step_seconds(obs.prefill_steps), minlength=len(obs.prefill_s))
    d = np.bincount(obs.decode_of, weights=cost.step_seconds(obs.decode_steps), minlength=len(obs.decode_s))
    return (p - obs.prefill_s) / obs.prefill_s, (d - obs.decode_s) / obs.decode_s


def fit(base: SimParams, block_size: int, obs: Observations, free: Sequence[str] = FREE,
        iterations: int = 60) -> FitResult:
    """Fit, drop the outliers, fit again (module docstring)."""
    first = _fit(base, block_size, obs, free, iterations)
    r = np.abs(np.concatenate([first.prefill_residuals, first.decode_residuals]))
    if not len(r):
        return first
    bound = max(3 * float(np.median(r)), 0.2)
    keep_p, keep_d = np.abs(first.prefill_residuals) <= bound, np.abs(first.decode_residuals) <= bound
    dropped = int((~keep_p).sum() + (~keep_d).sum())
    if not dropped or not keep_p.any() or not keep_d.any():
        return first
    p_steps, p_of = _keep(obs.prefill_steps, obs.prefill_of, keep_p)
    d_steps, d_of = _keep(obs.decode_steps, obs.decode_of, keep_d)
    kept = Observations(p_steps, p_of, obs.prefill_s[keep_p], d_steps, d_of, obs.decode_s[keep_d],
                        obs.prefill_requests, obs.decode_gaps)
    result = _fit(base, block_size, kept, free, iterations)
    result.dropped = dropped
    return result


def _keep(steps: StepWork, of: np.ndarray, keep: np.ndarray) -> tuple[StepWork, np.ndarray]:
    """The steps of the kept observations, and which kept observation each is of (renumbered)."""
    mask = keep[of]
    return (StepWork(*(np.asarray(getattr(steps, f))[mask] for f in StepWork.__dataclass_fields__)),
            np.cumsum(keep)[of[mask]] - 1)


def _fit(base: SimParams, block_size: int, obs: Observations, free: Sequence[str], iterations: int) -> FitResult:
    for name in free:
        if name not in FREE:
            raise FitError(f"--free {name}: not a fittable number; one of {', '.join(FREE)}")
    x0 = np.array([_log(_get(base, n), n) for n in free])

    def params_at(x: np.ndarray) -> SimParams:
        return with_numbers(base, {n: _unlog(v, n) for n, v in zip(free, x)})

    # D spans in absolute time per step of a typical step (their relative residuals, as the
    # report gives them, would pull the fit below the mean: a noisy span's 1/observed weighs the
    # fast ones more; the spans' times are all of a size, so absolute residuals lose nothing).
    steps = np.bincount(obs.decode_of, minlength=len(obs.decode_s))
    typical = float(np.median(obs.decode_s / np.maximum(steps, 1))) if len(obs.decode_s) else 1.0

    def r_of(x: np.ndarray) -> np.ndarray:
        p, d = residuals(params_at(x), block_size, obs)
        d_abs = d * obs.decode_s / (np.maximum(steps, 1) * typical)
        return np.concatenate([p, d_abs, np.sqrt(PRIOR_WEIGHT) * (x - x0)])

    x, r = x0.copy(), r_of(x0)
    mu = 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = 1e-5
            if _bounded(x + dx, free)[j] == x[j]:  # at its bound: the derivative from the inside
                dx[j] = -dx[j]
            jac[:, j] = (r_of(x + dx) - r) / dx[j]
        g, h = jac.T @ r, jac.T @ jac
        improved = False
        for _ in range(10):
            step = np.linalg.solve(h + mu * np.diag(np.diag(h) + 1e-12), -g)
            x_new = _bounded(x + step, free)
            r_new = r_of(x_new)
            if r_new @ r_new < r @ r:
                x, r, mu, improved = x_new, r_new, max(mu / 3, 1e-9), True
                break
            mu *= 4
        if not improved or np.abs(step).max() < 1e-7:
            break
    sensitivity = np.abs(jac[:len(r) - len(x)]).sum(axis=0) if len(r) > len(x) else np.zeros(len(x))
    determined = sensitivity > 1e-3 * len(obs)
    # What the run does not determine stays as it was; what it does, to 6 digits (below 1 ns: 0).
    values = {n: (round(_unlog(v, n), 12) if determined[j] else _get(base, n)) for j, (n, v) in enumerate(zip(free, x))}
    fitted = with_numbers(base, {n: float(f"{v:.6g}") for n, v in values.items()})
    numbers = [FittedNumber(n, _get(base, n), _get(fitted, n), bool(determined[j])) for j, n in enumerate(free)]
    p, d = residuals(fitted, block_size, obs)
    return FitResult(fitted, numbers, p, d, obs, residuals(base, block_size, obs))


def _log(v: float, name: str) -> float:
    # Overheads may be 0: log(v + a tenth of a millisecond) keeps them fittable from there.
    return float(np.log(v + _OFFSET if name.startswith("overheads.") else v))


def _unlog(x: float, name: str) -> float:
    return float(max(0.0, np.exp(x) - _OFFSET) if name.startswith("overheads.") else np.exp(x))


def _bounded(x: np.ndarray, free: Sequence[str]) -> np.ndarray:
    """Efficiencies at most 1 (log 0); overheads at least 0 (log of the offset)."""
    out = x.copy()
    for j, n in enumerate(free):
        out[j] = min(out[j], 0.0) if n.startswith("efficiency.") else max(out[j], np.log(_OFFSET))
    return out


_OFFSET = 1e-4


# ---- the fitted file ---------------------------------------------------------------------------
