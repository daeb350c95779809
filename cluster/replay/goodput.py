"""`vllm bench serve`'s result options on a replay's formal window: `--percentile-metrics`
(which of ttft, tpot, itl, e2el), `--metric-percentiles` (which percentiles, e.g. 50,90,99) and
`--goodput KEY:MS ...` (the requests that met every bound, and their rate: vLLM's "request
goodput"). Parsed here (a bad value: ValueError naming the flag), computed over the phase's
requests as the summary's stats are (cluster/replay/metrics.py: per_request, percentile), a
failed request a miss. `pdc plan` reads its --goodput bounds with `parse_goodput` too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.cluster.replay.metrics import per_request, percentile
from pdcluster.cluster.replay.records import RequestResult

METRICS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
DEFAULT_METRICS = ("ttft", "tpot", "itl")  # vllm bench serve's defaults
DEFAULT_PERCENTILES = (99.0,)


def parse_metrics(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: a comma-separated list of {', '.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles {text!r}: comma-separated percentiles above 0, at most 100 "
                         f"(e.g. 50,90,99)")
    return values


def parse_goodput(items: Sequence[str], keys: Sequence[str] = ("ttft", "tpot", "e2el")) -> dict[str, float]:
    """`KEY:MS` bounds, each key once."""
    bounds: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in keys:
            raise ValueError(f"--goodput {item!r}: KEY:MS with KEY one of {', '.join(keys)} (e.g. ttft:2000 tpot:6)")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the bound must be above 0 ms")
        if key in bounds:
            raise ValueError(f"--goodput {item!r}: the {key.upper()} bound is given twice")
        bounds[key] = ms
    return bounds


@dataclass(frozen=True)
class SloFigures:
    """A phase's chosen percentiles (ms) and, with bounds, its goodput."""

    phase: str
    percentiles: dict[str, dict[str, float | None]]  # metric -> "p99" -> ms
    goodput_bounds_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int | None = None  # met every bound (None: no bounds given)
    requests: int = 0
    goodput_per_s: float | None = None  # good requests per second of the phase


def slo_figures(results: Sequence[RequestResult], phase: str, duration_s: float | None,
                metrics: Sequence[str] = DEFAULT_METRICS, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                bounds_ms: dict[str, float] | None = None) -> SloFigures:
    rs = [r for r in results if r.phase == phase]
    ok = [per_request(r) for r in rs if r.ok]
    values = {"ttft": [m.ttft_s for m in ok if m.ttft_s is not None],
              "tpot": [m.tpot_s for m in ok if m.tpot_s is not None],
              "itl": [gap for m in ok for gap in m.itl_s], "e2el": [m.e2el_s for m in ok]}
    table = {m: {_name(q): percentile(sorted(values[m]), q) * 1e3 if values[m] else None for q in percentiles}
             for m in metrics}
    if not bounds_ms:
        return SloFigures(phase, table, requests=len(rs))
    good = 0
    for r in rs:
        if not r.ok:
            continue  # a failed or refused request met nothing
        m = per_request(r)
        got = {"ttft": m.ttft_s, "tpot": m.tpot_s, "e2el": m.e2el_s}
        good += all(got[k] is not None and got[k] * 1e3 <= bound for k, bound in bounds_ms.items())
    rate = good / duration_s if duration_s else None
    return SloFigures(phase, table, dict(bounds_ms), good, len(rs), rate)


def _name(q: float) -> str:
    return f"p{q:g}"


def format_slo(f: SloFigures) -> str:
    lines = [f"percentiles of the {f.phase} phase (ms):"]
    for metric, row in f.percentiles.items():
        cells = ", ".join(f"{name} {'-' if v is None else f'{v:,.2f}'}" for name, v in row.items())
        lines.append(f"  {METRICS[metric]:<5} {cells}")
    if f.good_requests is not None:
        bounds = " and ".join(f"{k.upper()} <= {v:g} ms" for k, v in f.goodput_bounds_ms.items())
        rate = "-" if f.goodput_per_s is None else f"{f.goodput_per_s:.3f} req/s"
        lines.append(f"goodput ({bounds}): {f.good_requests} of {f.requests} requests, {rate}")
    return "\n".join(lines)
