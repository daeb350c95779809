"""The HTML report's view per instance over time (router/report.py): for each P, the prefills it
had in progress and those queued at it; for each D, the requests it was running and the KV they
held (prompt + tokens generated so far). Step lines from the requests' own events, on the router
clock, one small chart per instance, so that a saturated P or a full D shows as a plateau."""

from __future__ import annotations

from html import escape

from pdcluster.router.run_store import Run
from pdcluster.router.timeline import RequestRecord
from pdcluster.router.timeline_views import NS_PER_MS, run_origin_ns

WIDTH, HEIGHT, LEFT, BOTTOM = 560, 120, 44, 22
SERIES = {"prefill": (("in progress", "#1f77b4"), ("queued", "#aec7e8")),
          "decode": (("running", "#2ca02c"), ("KV tokens held", "#9467bd"))}


def _steps(spans: list[tuple[int, int, float]]) -> list[tuple[int, float]]:
    """(start, end, weight) spans -> the running sum as (time, level) steps."""
    deltas: list[tuple[int, float]] = [(a, w) for a, b, w in spans if b > a] + [(b, -w) for a, b, w in spans if b > a]
    out, level = [], 0.0
    for t, d in sorted(deltas, key=lambda x: (x[0], x[1])):
        level += d
        out.append((t, level))
    return out


def _kv_spans(r: RequestRecord) -> list[tuple[int, int, float]]:
    """The KV D holds for a request: its prompt from D's scheduling, one more token with each."""
    start = r.events.get("d_scheduled")
    end = r.events.get("finish") or (r.token_ns[-1] if r.token_ns else None)
    if start is None or end is None or end <= start:
        return []
    spans = [(start, end, float(r.prompt_tokens))]
    spans += [(t, end, 1.0) for t in r.token_ns if start <= t < end]
    return spans


def series(run: Run) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """instance -> series name -> steps."""
    spans: dict[str, dict[str, list[tuple[int, int, float]]]] = {}
    for r in run.records:
        ev = r.events
        if r.prefill_instance and not r.local_prefill:
            p = spans.setdefault(r.prefill_instance, {"in progress": [], "queued": []})
            if "p_scheduled" in ev:
                p["in progress"].append((ev["p_scheduled"], ev.get("p_done", ev.get("finish", ev["p_scheduled"])), 1.0))
            if "p_queued" in ev:
                p["queued"].append((ev["p_queued"], ev.get("p_scheduled", ev.get("finish", ev["p_queued"])), 1.0))
        if r.decode_instance and "d_scheduled" in ev:
            d = spans.setdefault(r.decode_instance, {"running": [], "KV tokens held": []})
            d["running"].append((ev["d_scheduled"], ev.get("finish", ev["d_scheduled"]), 1.0))
            d["KV tokens held"] += _kv_spans(r)
    return {name: {k: _steps(v) for k, v in s.items()} for name, s in sorted(spans.items())}


def _columns(steps: list[tuple[int, float]], t0: int, end_ms: float, plot_w: int) -> list[tuple[int, float]]:
    """The steps as (pixel column, the highest level in it): a page of many requests stays small."""
    cols: dict[int, float] = {}
    last = 0.0
    for t, v in steps:
        col = min(plot_w, max(0, int((t - t0) / NS_PER_MS / end_ms * plot_w)))
        cols[col] = max(cols.get(col, last), v)
        last = v
    return sorted(cols.items())


def _chart(title: str, role: str, steps: dict[str, list[tuple[int, float]]], t0: int, end_ms: float) -> str:
    plot_w, plot_h = WIDTH - LEFT - 8, HEIGHT - BOTTOM - 14
    lines = [f'<text x="{LEFT}" y="11" font-weight="bold">{escape(title)}</text>']
    for k, (name, color) in enumerate(SERIES[role]):
        cols = _columns(steps.get(name, []), t0, end_ms, plot_w)
        top = max((v for _, v in cols), default=0.0) or 1.0
        path, last = [], 0.0
        for col, v in cols:
            x = LEFT + col
            path += [f"{x},{14 + plot_h * (1 - last / top):.1f}", f"{x},{14 + plot_h * (1 - v / top):.1f}"]
            last = v
        label = f"{name}: max {top:,.0f}"
        lines.append(f'<text x="{LEFT + 150 + 170 * k}" y="11" fill="{color}">{escape(label)}</text>')
        if path:
            lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{" ".join(path)}">'
                         f"<title>{escape(title)} {escape(name)} (each line scaled to its own max)</title></polyline>")
    lines.append(f'<line class="axis" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{14 + plot_h}" y2="{14 + plot_h}"/>'
                 f'<text x="{LEFT}" y="{HEIGHT - 4}">0</text>'
                 f'<text x="{LEFT + plot_w}" y="{HEIGHT - 4}" text-anchor="end">{end_ms:,.0f} ms</text>')
    return f'<svg class="instance" width="{WIDTH}" height="{HEIGHT}">{"".join(lines)}</svg>'


def instances_html(run: Run) -> str:
    t0 = run_origin_ns(run)
    end_ms = max(((t - t0) / NS_PER_MS for r in run.records for t in r.events.values()), default=1.0) or 1.0
    charts = []
    for name, steps in series(run).items():
        role = "prefill" if "in progress" in steps else "decode"
        charts.append(_chart(f"{name} ({role})", role, steps, t0, end_ms))
    return f'<div class="cdfs">{"".join(charts)}</div>' if charts else "<p>no instance activity recorded</p>"
