"""A run as ONE self-contained HTML page: its provenance, summary, each instance over time
(router/report_instances.py), Gantt, TTFT attribution bars, phase CDFs.

The charts are SVG generated here (no JavaScript, no external resources), so
the page opens from a file on a machine without internet and stays readable
when archived with a run. Hover a segment for its exact numbers (SVG <title>).
"""

from __future__ import annotations

import datetime as dt
import math
from html import escape
from pathlib import Path

from pdcluster.proto.load_phases import phase_of
from pdcluster.router.attribution import CRITICAL_PATH, INTERVALS, OPTIONAL_PARTS, attribute, intervals
from pdcluster.router.report_instances import instances_html
from pdcluster.router.run_store import Run
from pdcluster.router.timeline_views import (
    NS_PER_MS,
    Stats,
    Summary,
    human_bytes,
    is_failed,
    last_event,
    run_origin_ns,
    summarize,
)

PART_COLORS = {"migration": "#8c564b", "queue": "#9e9e9e", "prefill": "#1f77b4", "transfer": "#ff7f0e", "d_wait": "#9467bd",
               "first_decode": "#2ca02c", "local_prefill": "#d62728", "ttft": "#222222"}
INTERVAL_COLORS = {"router": "#bdbdbd", "to_p": "#d9d9d9", "p_queue": "#aec7e8", "prefill": "#1f77b4", "handoff": "#8c8c8c",
                   "d_queue": "#c5b0d5", "transfer": "#ff7f0e", "d_kv_wait": "#9467bd", "first_decode": "#2ca02c",
                   "return": "#636363", "decode": "#98df8a", "local_prefill": "#d62728"}
MAX_ROWS = 1000  # beyond this a per-request chart is unreadable anyway: show the first ones by arrival
LABEL_W, ROW_H, AXIS_H = 130, 16, 44  # LABEL_W: at least; wider for long request ids (shown whole)
CHAR_W = 6.6  # px per character of an 11px label

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.muted { color: #666; font-size: 12px; }
table { border-collapse: collapse; margin: 6px 0 12px; } td, th { padding: 2px 10px; text-align: right; }
th { border-bottom: 1px solid #999; } td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #f6f6f6; } table.text td, table.text th { text-align: left; }
.cards { display: flex; gap: 12px; } .card { border: 1px solid #ddd; border-radius: 6px; padding: 6px 14px; }
.card b { font-size: 20px; display: block; } .bad b { color: #c62828; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }
.cdfs { display: flex; flex-wrap: wrap; gap: 8px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; } svg .failed { fill: #c62828; } svg .phase { fill: #666; font-style: italic; }
svg .grid { stroke: #e4e4e4; } svg .axis { stroke: #888; }
"""


def _ms(ns: float) -> float:
    return ns / NS_PER_MS


def _ticks(hi: float, n: int = 8) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k) from 0 to at least hi."""
    hi = hi if hi > 0 else 1.0
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(math.ceil(hi / step - 1e-9) + 1)]


def _num(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"


def _x_axis(ticks: list[float], x, top: float, bottom: float, title: str) -> str:
    out = [f'<line class="grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top}" y2="{bottom}"/>'
           f'<text x="{x(t):.1f}" y="{bottom + 14}" text-anchor="middle">{_num(t)}</text>' for t in ticks]
    out.append(f'<line class="axis" x1="{x(0):.1f}" x2="{x(ticks[-1]):.1f}" y1="{bottom}" y2="{bottom}"/>')
    mid = (x(0) + x(ticks[-1])) / 2
    out.append(f'<text x="{mid:.1f}" y="{bottom + 32}" text-anchor="middle">{escape(title)}</text>')
    return "".join(out)


def _legend(colors: dict[str, str]) -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{escape(n)}</span>' for n, c in colors.items())
    return f'<div class="legend">{items}</div>'


def _rect(x: float, y: float, w: float, h: float, color: str, tip: str, extra: str = "") -> str:
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.8):.2f}" height="{h:.2f}" fill="{color}"{extra}>'
            f"<title>{escape(tip)}</title></rect>")


def _rows(run: Run) -> list:
    """The requests the per-request charts draw: the first MAX_ROWS by arrival."""
    return sorted(run.records, key=lambda r: r.events.get("arrival", min(r.events.values(), default=0)))[:MAX_ROWS]


def _label_w(recs) -> int:
    return max(LABEL_W, int(CHAR_W * max((len(r.request_id) for r in recs), default=0)) + 12)


def _gantt(run: Run, width: int = 1150) -> str:
    t0 = run_origin_ns(run)
    recs = _rows(run)
    label_w = _label_w(recs)
    end = max((_ms(t - t0) for r in recs for t in r.events.values()), default=1.0)
    ticks = _ticks(end)
    plot_w = width - label_w - 20

    def x(ms: float) -> float:
        return label_w + ms / ticks[-1] * plot_w

    height = len(recs) * ROW_H + AXIS_H + 6
    rows, phase = [], None
    for i, r in enumerate(recs):
        y = 4 + i * ROW_H
        failed = is_failed(r)
        cls = ' class="failed"' if failed else ""
        stripe = "#fafafa" if i % 2 else "#fff"
        parts = [f'<rect x="{label_w}" y="{y}" width="{plot_w}" height="{ROW_H}" fill="{stripe}"/>',
                 (f'<text x="{label_w - 6}" y="{y + ROW_H - 4}" text-anchor="end"'
                 f'{cls}>{escape(r.request_id)}</text>')]
        if (now := phase_of(r.request_id)) != phase and now is not None:  # a replay's phase begins here
            parts.append(f'<line class="axis" x1="{label_w}" x2="{label_w + plot_w}" y1="{y}" y2="{y}"/>'
                         f'<text class="phase" x="{label_w + plot_w - 4}" y="{y + 11}" text-anchor="end">'
                         f"{escape(now)} phase</text>")
        phase = now
        for iv in sorted(intervals(r), key=lambda iv: iv.name == "transfer"):  # the KV pull on top
            s, e = _ms(iv.start_ns - t0), _ms(iv.end_ns - t0)
            tip = f"{r.request_id} {iv.name} on {iv.where}: {e - s:.3f} ms ({s:.3f} → {e:.3f} ms)"
            if iv.name == "transfer":  # lower half, outlined: it may run under other phases
                parts.append(_rect(x(s), y + ROW_H / 2, x(e) - x(s), ROW_H / 2 - 1, INTERVAL_COLORS[iv.name], tip,
                                   ' stroke="#a04000" stroke-width="0.6"'))
            else:
                parts.append(_rect(x(s), y + 2, x(e) - x(s), ROW_H - 4, INTERVAL_COLORS[iv.name], tip))
        if failed and r.events:
            at = _ms(max(r.events.values()) - t0)
            tip = f"{r.request_id} failed after {last_event(r)}: {r.error or 'no error recorded'}"
            parts.append(f'<text class="failed" x="{x(at):.1f}" y="{y + ROW_H - 4}" text-anchor="middle">✕'
                         f"<title>{escape(tip)}</title></text>")
        rows.append(f'<g class="row" data-request-id="{escape(r.request_id)}" data-phase="{escape(phase or "")}">'
                    f'{"".join(parts)}</g>')
    axis = _x_axis(ticks, x, 4, height - AXIS_H + 4, "ms since the first arrival (router clock)")
    return (f'<svg id="gantt-svg" width="{width}" height="{height}">'
            f'{axis}{"".join(rows)}</svg>')


def _attribution_bars(run: Run, width: int = 1150) -> str:
    recs = _rows(run)
    label_w = _label_w(recs)
    atts = [attribute(r) for r in recs]
    end = max((sum(a.parts_ns.values()) for a in atts), default=0)
    ticks = _ticks(_ms(end))
    right = 190  # room for the TTFT / failure label
    plot_w = width - label_w - right

    def x(ms: float) -> float:
        return label_w + ms / ticks[-1] * plot_w

    height = len(recs) * ROW_H + AXIS_H + 6
    rows = []
    for i, (r, a) in enumerate(zip(recs, atts)):
        y, at = 4 + i * ROW_H, 0.0
        failed = is_failed(r)
        cls = ' class="failed"' if failed else ""
        parts = [(f'<text x="{label_w - 6}" y="{y + ROW_H - 4}" text-anchor="end"'
                 f'{cls}>{escape(r.request_id)}</text>')]
        for name in CRITICAL_PATH:
            if name in a.parts_ns:
                d = _ms(a.parts_ns[name])
                share = f" ({100 * a.parts_ns[name] / a.ttft_ns:.1f}% of TTFT)" if a.ttft_ns else ""
                parts.append(_rect(x(at), y + 2, x(at + d) - x(at), ROW_H - 4, PART_COLORS[name],
                                   f"{r.request_id} {name}: {d:.3f} ms{share}"))
                at += d
        label = (f"TTFT {_ms(a.ttft_ns):.2f} ms" if a.ttft_ns is not None
                 else f"failed after {a.stopped_after or last_event(r) or '(nothing)'}")
        parts.append(f'<text x="{x(at) + 6:.1f}" y="{y + ROW_H - 4}"{cls}>{escape(label)}</text>')
        rows.append(f'<g class="bar" data-request-id="{escape(r.request_id)}">{"".join(parts)}</g>')
    axis = _x_axis(ticks, x, 4, height - AXIS_H + 4, "ms of TTFT, split along the critical path")
    return (f'<svg id="attribution-svg" width="{width}" height="{height}">'
            f'{axis}{"".join(rows)}</svg>')


def _cdf(name: str, values_ns: list[int], stats: Stats | None, color: str) -> str:
    w, h, left, top, bottom = 370, 220, 50, 24, 176
    v = sorted(_ms(n) for n in values_ns)
    ticks = _ticks(v[-1] * 1.04 if v else 1.0, 5)  # headroom: the last step must not hide in the frame

    def x(ms: float) -> float:
        return left + ms / ticks[-1] * (w - left - 14)

    def y(frac: float) -> float:
        return bottom - frac * (bottom - top)

    out = [_x_axis(ticks, x, top, bottom, "ms")]
    for f in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line class="grid" x1="{left}" x2="{x(ticks[-1]):.1f}" y1="{y(f):.1f}" y2="{y(f):.1f}"/>'
                   f'<text x="{left - 4}" y="{y(f) + 4:.1f}" text-anchor="end">{f:g}</text>')
    out.append(f'<line class="axis" x1="{left}" x2="{left}" y1="{top}" y2="{bottom}"/>'
               f'<text transform="translate(12 {(top + bottom) / 2}) rotate(-90)" text-anchor="middle">'
               "fraction of requests</text>")
    if v:  # a step per request: the fraction of requests at most this long
        path = [f"M {x(0):.2f} {y(0):.2f}"]
        for i, ms in enumerate(v, 1):
            path.append(f"H {x(ms):.2f} V {y(i / len(v)):.2f}")
        path.append(f"H {x(ticks[-1]):.2f}")
        out.append(f'<path d="{" ".join(path)}" fill="none" stroke="{color}" stroke-width="2"/>')
    title = f"{name}: n={len(v)}" + (f", p50 {stats.p50_ms:.2f}, p99 {stats.p99_ms:.2f} ms" if stats else ", no data")
    out.append(f'<text x="{left}" y="14" style="font-weight:600">{escape(title)}</text>')
    return f'<svg class="cdf" width="{w}" height="{h}">{"".join(out)}</svg>'


def _stats_cells(s: Stats | None) -> str:
    if s is None:
        return '<td>0</td><td colspan="4">-</td>'
    return "".join(f"<td>{v}</td>" for v in (s.n, *(f"{m:.2f}" for m in (s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms))))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _summary_html(s: Summary) -> str:
    head = "<tr><th>{}</th><th>n</th><th>mean ms</th><th>p50 ms</th><th>p90 ms</th><th>p99 ms</th>{}</tr>"
    cards = "".join(f'<div class="card{" bad" if bad else ""}"><b>{v}</b>{k}</div>' for k, v, bad in (
        ("requests", s.total, False), ("completed", s.completed, False), ("failed", s.failed, s.failed > 0),
        ("P hit ratio", _pct(s.p_hit_ratio), False), ("D hit ratio", _pct(s.d_hit_ratio), False),
        ("tokens transferred", f"{s.transferred_tokens:,}", False)))
    crit = [head.format("TTFT part", "<th>share of TTFT</th>")]
    for name in (*_shown(s), "ttft"):
        share = "100%" if name == "ttft" and s.shares else _pct(s.shares.get(name))
        crit.append(f'<tr><td><i style="color:{PART_COLORS[name]}">■</i> {"TTFT" if name == "ttft" else name}</td>'
                    f"{_stats_cells(s.phases.get(name))}<td>{share}</td></tr>")
    ivs = [head.format("interval (they overlap)", "")]
    ivs += [f"<tr><td>{n} <span class=muted>{w}</span></td>{_stats_cells(s.intervals.get(n))}</tr>"
            for n, _, _, w in INTERVALS if n in s.intervals]
    dec = [head.format("decode", ""), f"<tr><td>ITL</td>{_stats_cells(s.itl)}</tr>",
           f"<tr><td>TPOT</td>{_stats_cells(s.tpot)}</tr>"]
    groups = ", ".join(f"{escape(g)}: {human_bytes(b)}" for g, b in s.bytes_per_group.items()) or "none"
    p_tier = f" ({s.p_tier_tokens:,} from its host tier)" if s.p_tier_tokens else ""
    d_tier = f" ({s.d_tier_tokens:,} from its host tier)" if s.d_tier_tokens else ""
    pool = f" ({s.pool_tokens:,} read from a P's host tier)" if s.pool_tokens else ""
    html = [f'<div class="cards">{cards}</div>',
            (f'<p class="muted">Shares are over the {s.attributed} requests that reached their first token with every '
            "part recorded; a part's statistics are over every request that has it.</p>"),
            f'<table id="critical-path">{"".join(crit)}</table><table>{"".join(ivs)}</table>',
            f'<table>{"".join(dec)}</table>',
            f"<p>Prompt tokens {s.prompt_tokens:,}: P cached {s.p_cached_tokens:,}{p_tier}, D cached {s.d_cached_tokens:,}{d_tier}, "
            f"transferred {s.transferred_tokens:,}{pool}. KV bytes transferred: {groups}."
            + (f" KV pull failed and D recomputed: {s.recomputed} requests." if s.recomputed else "") + "</p>"]
    if (loc := s.local) is not None:
        rows = [("TTFT, D alone", loc.ttft_local), ("TTFT, through P", loc.ttft_remote),
                ("others' ITL on D, during a local prefill", loc.itl_during_local),
                ("others' ITL on D, without one", loc.itl_without_local)]
        reasons = ", ".join(f"{escape(k)} {n}" for k, n in loc.reasons.items())
        html.append(f'<p id="local-prefill">Local prefill: {loc.local} of {loc.local + loc.remote} completed requests '
                    f"prefilled on their D alone ({_pct(loc.local_share)}); decisions: {reasons}.</p>"
                    f'<table>{head.format("local prefill", "")}'
                    + "".join(f"<tr><td>{n}</td>{_stats_cells(st)}</tr>" for n, st in rows) + "</table>")
    if s.failures:
        kinds = "".join(f"<tr><td>{k.count}</td><td>{escape(k.stopped_after or '(nothing)')}</td>"
                        f"<td>{escape(k.kind)}</td></tr>" for k in s.failure_kinds)
        each = "".join(f"<tr><td>{escape(f.request_id)}</td><td>{escape(f.stopped_after or '(nothing)')}</td>"
                       f"<td>{escape(f.error or 'no error recorded')}</td></tr>" for f in s.failures[:50])
        more = f'<p class="muted">... and {len(s.failures) - 50} more</p>' if len(s.failures) > 50 else ""
        html.append(f'<table id="failures" class="text"><tr><th>failed</th><th>stopped after</th><th>error</th></tr>'
                    f'{kinds}</table><table class="text"><tr><th>request</th><th>stopped after</th><th>error</th>'
                    f"</tr>{each}</table>{more}")
    return "".join(html)


def _shown(s: Summary) -> tuple[str, ...]:
    """The critical path's parts, an optional one (local_prefill, migration) only if some request has it."""
    return tuple(n for n in CRITICAL_PATH if n not in OPTIONAL_PARTS or n in s.phases)


def _provenance(run: Run) -> str:
    """What the run ran: the spec's name, model, engines (and a simulated engine's parameter file)."""
    spec = run.meta.spec if isinstance(run.meta.spec, dict) else {}
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {"name": spec.get("model")}
    engine = spec.get("engine") if isinstance(spec.get("engine"), dict) else {}
    kind = engine.get("kind") or "vllm"
    sim = (spec.get("sim") or {}).get("params")
    parts = [f"spec <b>{escape(str(spec.get('name', '?')))}</b>",
             f"model {escape(str(model.get('name') or model.get('path', '?')))}",
             f"P{(spec.get('prefill') or {}).get('instances', '?')} D{(spec.get('decode') or {}).get('instances', '?')}",
             f"{escape(kind)} engines" + (f", parameter file {escape(str(sim))}" if kind == "sim" and sim else "")]
    return "; ".join(parts)


def render_report(run: Run, window: str | None = None) -> str:
    """`window`: which of the run's requests these are (router/timeline_window.py's line)."""
    s = summarize(run)
    t0 = run_origin_ns(run)
    atts = [attribute(r) for r in run.records]
    cdfs = [_cdf(n, [a.parts_ns[n] for a in atts if n in a.parts_ns], s.phases.get(n), PART_COLORS[n])
            for n in _shown(s)]
    cdfs.append(_cdf("TTFT", [a.ttft_ns for a in atts if a.ttft_ns is not None], s.phases.get("ttft"), "#222"))
    started = dt.datetime.fromtimestamp(run.meta.started_wall_ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    # The wall time of the plots' zero: the router clock anchor mapped forward to the first arrival.
    zero = dt.datetime.fromtimestamp((run.meta.started_wall_ns + t0 - run.meta.started_mono_ns) / 1e9, dt.UTC)
    insts = ", ".join(f"{escape(i.name)} ({escape(i.role)}, {escape(i.node_ip)})" for i in run.meta.instances) or "-"
    vers = ", ".join(f"{escape(k)} {escape(v)}" for k, v in run.meta.versions.items())
    shown = f" (first {MAX_ROWS} of {len(run.records)} by arrival)" if len(run.records) > MAX_ROWS else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pdcluster run {escape(run.meta.run_id)}</title>
<link rel="icon" href="data:,"><style>{CSS}</style></head><body>
<h1>Run {escape(run.meta.run_id)}</h1>
<div class="muted">started {started}; time zero = first arrival, {zero.strftime("%H:%M:%S.%f")[:-3]} UTC;
instances: {insts}<br>{vers}</div>
<p id="provenance">{_provenance(run)}</p>{f'<p id="window" class="muted">{escape(window)}</p>' if window else ""}
<section id="summary"><h2>Summary</h2>{_summary_html(s)}</section>
<section id="instances"><h2>Each instance over time</h2>{instances_html(run)}
<p class="muted">P: prefills in progress (scheduled, not done) and queued at it; D: requests running and the KV
tokens they held. Each line is scaled to its own maximum.</p></section>
<section id="gantt"><h2>Requests over time{shown}</h2>{_legend(INTERVAL_COLORS)}{_gantt(run)}
<p class="muted">One row per request; the KV pull is the outlined lower-half bar. ✕ marks where a failed request
stopped. Hover a segment for its numbers.</p></section>
<section id="attribution"><h2>TTFT attribution per request{shown}</h2>
{_legend({n: PART_COLORS[n] for n in _shown(s)})}{_attribution_bars(run)}</section>
<section id="cdf"><h2>Distribution of each part (CDF over requests)</h2>
<div class="cdfs">{"".join(cdfs)}</div></section>
</body></html>
"""


def write_report(run: Run, path: str | Path, window: str | None = None) -> Path:
    path = Path(path)
    path.write_text(render_report(run, window), encoding="utf-8")
    return path
