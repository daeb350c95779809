"""A plan (cluster/sim/plan.py) as a terminal table, JSON, and a self-contained HTML page: the
table, and the Pareto plot of TTFT against TPOT (at the SLO's percentile) of every configuration,
the SLO's bounds drawn, the chosen one marked. Inline SVG and CSS only: no script, nothing fetched.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from pathlib import Path

from pdcluster.cluster.sim.plan_rank import decided_by, pareto, tied
from pdcluster.cluster.sim.plan_types import MISS, Outcome, Plan, pname


def _ms(v: float | None) -> str:
    """A latency in ms; "miss" where the percentile falls on refused or failed requests."""
    return "-" if v is None else "miss" if v == MISS else f"{v * 1e3:,.1f}"


def rows(p: Plan) -> list[list[str]]:
    q = pname(p.slo.percentile)
    header = ["#", "", "P:D", "budget", "seqs", "policy", "cap", "D prefills", f"TTFT {q} ms", f"TPOT {q} ms", "E2E mean ms",
              "req/s", "goodput/dev", "refused", "SLO"]
    tiers = any(o.config.host_tier_gib is not None for o in p.outcomes)  # a column only when swept
    if tiers:
        header.insert(8, "tier GiB")
    out = [header]
    for i, o in enumerate(p.outcomes, 1):
        c = o.config
        mark = "=" if i > 1 and tied(p.chosen, o) else ""  # nothing measured tells it from the chosen one
        row = [str(i), mark, c.split, str(c.max_num_batched_tokens), str(c.max_num_seqs), c.policy,
               str(c.max_in_flight or "-"), "-" if c.local_prefill is None else "never" if c.local_prefill == 0 else f"<= {c.local_prefill}", _ms(o.ttft_s), _ms(o.tpot_s), _ms(o.e2e_mean_s),
               f"{o.throughput:.2f}", f"{o.goodput_per_device:.3f}", str(o.failed),
               "met" if o.slo_met else "missed"]
        if tiers:
            row.insert(8, "-" if c.host_tier_gib is None else f"{c.host_tier_gib:g}")
        out.append(row)
    return out


def format_table(p: Plan) -> str:
    table = rows(p)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def slo_text(p: Plan) -> str:
    q, s = pname(p.slo.percentile), p.slo
    parts = []
    if s.ttft_s is not None:
        parts.append(f"TTFT {q} <= {s.ttft_s * 1e3:,.0f} ms")
    if s.tpot_s is not None:
        parts.append(f"TPOT {q} <= {s.tpot_s * 1e3:,.1f} ms")
    if s.min_throughput is not None:
        parts.append(f"throughput >= {s.min_throughput:g} req/s")
    return ", ".join(parts)


def to_json(p: Plan) -> str:
    def outcome(o: Outcome) -> dict:  # a percentile on refused or failed requests: null (JSON has no inf)
        h = p.headrooms.get(o.config)
        d = dataclasses.asdict(o) | {"label": o.config.label, "headroom": dataclasses.asdict(h) if h else None,
                                     "real_if_errs_as_checked": real_band(p, o)}
        return {k: None if v == MISS else v for k, v in d.items()}
    provenance = dataclasses.asdict(p.provenance) if p.provenance else None
    if provenance and provenance["error"] is not None:
        provenance["error"] = provenance["error"].model_dump()
    return json.dumps({"devices": p.devices, "workload": p.workload, "slo": dataclasses.asdict(p.slo),
                       "provenance": provenance, "chosen": outcome(p.chosen), "decided_by": decided_by(p),
                       "twin": None if p.twin is None else {"plan": "twin/plan.json", "params": p.twin.provenance.params,
                                                            "chosen": outcome(p.twin.chosen)},
                       "tied_with_chosen": [o.config.label for o in p.outcomes[1:] if tied(p.chosen, o)],
                       "configurations": [outcome(o) for o in p.outcomes]}, indent=1)


def real_band(p: Plan, o: Outcome) -> dict[str, tuple[float, float]] | None:
    """Where the real TTFT and TPOT percentiles would fall if the model errs as it did when checked
    (the parameter file's `error`: measured on means); None: never checked, or nothing measured."""
    e = p.provenance.error if p.provenance else None
    if e is None or not o.measured:
        return None
    return {"ttft_s": e.real_range("ttft", o.ttft_s), "tpot_s": e.real_range("tpot", o.tpot_s)}


def band_text(p: Plan, o: Outcome) -> str:
    """The band in words, or what stands in for it."""
    band, q = real_band(p, o), pname(p.slo.percentile)
    if band is None:
        return ("no error band: this model was never compared with real engines" if not (p.provenance and
                p.provenance.error) else "no error band: nothing measured")
    return (f"if it errs as when checked: real TTFT {q} {_ms_span(*band['ttft_s'])} ms, TPOT {q} "
            f"{_ms_span(*band['tpot_s'])} ms (the check's band is on means)")


def _ms_span(a: float, b: float) -> str:
    def ms(v: float) -> str:
        return f"{v * 1e3:,.0f}" if v >= 0.1 else f"{v * 1e3:.1f}"
    return ms(a) if ms(a) == ms(b) else f"{ms(a)}-{ms(b)}"


def provenance_lines(p: Plan) -> list[str]:
    """What the answer rests on (plan.Provenance), a line each; a plan made by hand says so."""
    return p.provenance.lines() if p.provenance else ["model: not recorded (a plan made by hand)"]


W, H, PAD = 760, 460, 64


def _log_axis(values: list[float], px0: float, px1: float):
    """A log10 scale over `values` (positive) onto pixels px0..px1: (map, ticks at 1, 2, 5 x 10^k)."""
    lo, hi = min(values), max(values)
    if hi / lo < 2:  # one point, or a few close ones: a readable span around them
        lo, hi = lo / 1.5, hi * 1.5
    lo, hi = lo / 1.15, hi * 1.15
    a, b = math.log10(lo), math.log10(hi)

    def to_px(v: float) -> float:
        return px0 + (math.log10(v) - a) / (b - a) * (px1 - px0)
    ticks = [m * 10 ** k for k in range(math.floor(a), math.ceil(b) + 1) for m in (1, 2, 5) if lo <= m * 10 ** k <= hi]
    return to_px, ticks


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:g}"


def _svg(p: Plan) -> str:
    """TTFT against TPOT on log axes, a point per configuration (its label on hover), the SLO's bounds,
    the Pareto front among the configurations that met the SLO, the chosen one ringed."""
    pts = [o for o in p.outcomes if o.measured and o.ttft_s > 0 and o.tpot_s > 0]
    if not pts:
        return "<p>No configuration finished a request: nothing to plot.</p>"
    xs = [o.ttft_s for o in pts] + ([p.slo.ttft_s] if p.slo.ttft_s else [])
    ys = [o.tpot_s * 1e3 for o in pts] + ([p.slo.tpot_s * 1e3] if p.slo.tpot_s else [])
    x, xticks = _log_axis(xs, PAD, W - PAD)
    y, yticks = _log_axis(ys, H - PAD, PAD)
    q = pname(p.slo.percentile)
    parts = [f'<svg id="pareto" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" role="img" aria-label="TTFT against TPOT per configuration">',
             f'<rect x="{PAD}" y="{PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" class="frame"/>']
    for t in xticks:
        parts.append(f'<line x1="{x(t):.1f}" y1="{PAD}" x2="{x(t):.1f}" y2="{H - PAD}" class="grid"/>'
                     f'<text x="{x(t):.1f}" y="{H - PAD + 18}" class="tick">{_num(t)}</text>')
    for t in yticks:
        parts.append(f'<line x1="{PAD}" y1="{y(t):.1f}" x2="{W - PAD}" y2="{y(t):.1f}" class="grid"/>'
                     f'<text x="{PAD - 8}" y="{y(t) + 4:.1f}" class="tick end">{_num(t)}</text>')
    parts.append(f'<text x="{W / 2}" y="{H - 16}" class="axis">TTFT {q} (s, log scale)</text>')
    parts.append(f'<text x="18" y="{H / 2}" class="axis" transform="rotate(-90 18 {H / 2})">TPOT {q} (ms, log '
                 f'scale)</text>')
    if p.slo.ttft_s:
        parts.append(f'<line x1="{x(p.slo.ttft_s):.1f}" y1="{PAD}" x2="{x(p.slo.ttft_s):.1f}" y2="{H - PAD}" '
                     f'class="slo"/>')
    if p.slo.tpot_s:
        parts.append(f'<line x1="{PAD}" y1="{y(p.slo.tpot_s * 1e3):.1f}" x2="{W - PAD}" '
                     f'y2="{y(p.slo.tpot_s * 1e3):.1f}" class="slo"/>')
    front = pareto([o for o in pts if o.slo_met])
    if len(front) > 1:
        path = " ".join(f"{x(o.ttft_s):.1f},{y(o.tpot_s * 1e3):.1f}" for o in front)
        parts.append(f'<polyline points="{path}" class="front"/>')
    for o in pts:
        cls = "met" if o.slo_met else "missed"
        tip = html.escape(f"#{p.outcomes.index(o) + 1} {o.config.label}: TTFT {q} {o.ttft_s:.3f} s, TPOT {q} "
                          f"{o.tpot_s * 1e3:.2f} ms, goodput {o.goodput_per_device:.3f} req/s/device, SLO {cls}")
        parts.append(f'<circle cx="{x(o.ttft_s):.1f}" cy="{y(o.tpot_s * 1e3):.1f}" r="5" class="point {cls}">'
                     f'<title>{tip}</title></circle>')
    c = p.chosen
    if c in pts:
        cx, cy = x(c.ttft_s), y(c.tpot_s * 1e3)
        parts.append(f'<circle id="chosen" cx="{cx:.1f}" cy="{cy:.1f}" r="11" class="chosen"/>')
        parts.append(f'<text x="{cx + 14:.1f}" y="{cy - 10:.1f}" class="label">chosen: '
                     f'P:D {c.config.split}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
#answer { border-left: 6px solid #2a8a3e; padding: 4px 16px; background: #f3faf4; }
#answer.missed { border-color: #c44; background: #fdf3f3; }
#answer .verdict { font-size: 17px; }
table { border-collapse: collapse; margin-top: 8px; }
td, th { padding: 3px 8px; border-bottom: 1px solid #ddd; text-align: right; }
td.cmd { text-align: left; font-size: 11px; max-width: 360px; } td.cmd code { display: block; }
tr.chosen td { background: #fff5cc; font-weight: 600; }
#provenance { background: #f4f4f4; padding: 8px 12px; white-space: pre-wrap; }
.frame { fill: none; stroke: #999; } .grid { stroke: #eee; }
.tick { font-size: 11px; fill: #555; text-anchor: middle; } .tick.end { text-anchor: end; }
.axis { font-size: 13px; text-anchor: middle; fill: #222; }
.slo { stroke: #c33; stroke-dasharray: 6 4; }
.front { fill: none; stroke: #36c; stroke-width: 1.5; }
.point.met { fill: #2a8a3e; } .point.missed { fill: #c44; opacity: 0.7; }
.chosen { fill: none; stroke: #e6a100; stroke-width: 3; }
.label { font-size: 12px; font-weight: 600; fill: #8a6000; }
"""


def rerun_command(p: Plan, out: Path, rank: int) -> str:
    """The command that runs configuration `rank` (1: the chosen) again with its timelines, for
    `pdc timeline report`; "" for a plan made by hand."""
    if p.sim_base is None:
        return ""
    return " ".join(["pdc sim run", str(out / "configs" / f"{rank:02d}.yaml"), *p.rerun_flags,
                     "--out", str(out / "runs" / f"{rank:02d}")])


def verdict(p: Plan) -> str:
    """The answer in a sentence: what to run, whether it meets the SLO, and its figures."""
    c, q = p.chosen, pname(p.slo.percentile)
    def ms(v: float | None) -> str:
        return f"{_ms(v)} ms" if v is not None and v != MISS else "a miss" if v == MISS else "none"
    figures = f"TTFT {q} {ms(c.ttft_s)}, TPOT {q} {ms(c.tpot_s)}, {c.goodput_per_device:.3f} req/s per device"
    if c.slo_met:
        return f"Run {c.config.label}: it meets the SLO ({figures})."
    return f"No configuration meets the SLO. Closest: {c.config.label} ({figures}, {c.failed} refused or failed)."


def answer_details(p: Plan) -> list[tuple[str, str, str]]:
    """(id, label, text) of what follows the chosen configuration's verdict: its error band, where
    its time goes and its headroom (if searched). The terminal, the page and the twin's lines."""
    from pdcluster.cluster.sim.plan_headroom import text

    c = p.chosen
    out = [("band", "Error band", band_text(p, c))]
    if c.anatomy is not None:
        out.append(("anatomy", "Where its time goes", c.anatomy.line()))
    if (tiers := tier_text(p)) is not None:
        out.append(("tier", "What the host tier buys", tiers))
    if c.config in p.headrooms and p.cfg is not None:
        out.append(("headroom", "Headroom", text(p.headrooms[c.config], p.cfg)))
    return out


def tier_text(p: Plan) -> str | None:
    """The chosen configuration at each host tier size tried: its hit and TTFT; None if one size only."""
    c = p.chosen.config
    same = [o for o in p.outcomes if dataclasses.replace(o.config, host_tier_gib=None) ==
            dataclasses.replace(c, host_tier_gib=None)]
    if len({o.config.host_tier_gib for o in same}) < 2:
        return None
    spec_gib = (p.sim_base.role_engine("prefill").host_tier_gib or 0) if p.sim_base is not None else 0

    def gib(o: Outcome) -> float:
        return spec_gib if o.config.host_tier_gib is None else o.config.host_tier_gib

    q = pname(p.slo.percentile)
    parts = []
    for o in sorted(same, key=gib):
        hit = "-" if o.hit_ratio is None else f"{o.hit_ratio:.1%}"
        chosen = " (chosen)" if o is p.chosen else ""
        parts.append(f"{gib(o):g} GiB: hit {hit}, TTFT {q} {_ms(o.ttft_s)} ms{chosen}")
    return "; ".join(parts)


def _answer_details(p: Plan) -> str:
    parts = [f'<p id="{id_}">{label}: {html.escape(text)}.</p>' for id_, label, text in answer_details(p)]
    if p.twin is not None:
        parts.append(f'<div id="twin"><p><b>{html.escape(twin_heading(p.twin))}</b></p><ul>'
                     + "".join(f"<li>{html.escape(line)}</li>" for line in twin_lines(p.twin))
                     + '</ul><p>Its whole plan: <a href="twin/plan.html">twin/plan.html</a>.</p></div>')
    return "\n".join(parts)


def twin_heading(t: Plan) -> str:
    prov = t.provenance
    fitted = f", fitted to {prov.fitted_to}" if prov and prov.fitted_to else ""
    return f"Side by side, the same sweep on the calibrated twin {prov.params if prov else '?'}{fitted}:"


def twin_lines(t: Plan) -> list[str]:
    """The twin plan's answer, as the main one's is given."""
    return [verdict(t), f"Decided by {decided_by(t)}."] + [f"{label}: {text}." for _, label, text in
                                                             answer_details(t)]


def render_html(p: Plan, out: Path | None = None) -> str:
    table = rows(p)
    commands = [rerun_command(p, out, i) if out else "" for i in range(1, len(p.outcomes) + 1)]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table[0]) + ("<th>re-run (then pdc timeline report "
                                                                        "OUT/timeline)</th>" if any(commands) else "")
    body = "\n".join(f'<tr{" class=chosen" if i == 0 else ""}>'
                     + "".join(f"<td>{html.escape(cell)}</td>" for cell in r)
                     + (f'<td class="cmd"><details><summary>command</summary><code>{html.escape(commands[i])}'
                        f'</code></details></td>' if commands[i] else "")
                     + "</tr>" for i, r in enumerate(table[1:]))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pdc plan: {html.escape(p.workload)} on {p.devices} devices</title>
<style>{CSS}</style></head><body>
<h1>pdc plan: {html.escape(p.workload)} on {p.devices} devices</h1>
<section id="answer" class="{"met" if p.chosen.slo_met else "missed"}">
<p class="verdict" id="chosen-text">{html.escape(verdict(p))}</p>
{_answer_details(p)}
<p>Decided by {html.escape(decided_by(p))}. SLO: {html.escape(slo_text(p))}, over every request sent (a refused or
failed one a miss).</p>
<pre id="provenance">{html.escape(chr(10).join(provenance_lines(p)))}</pre>
</section>
<h2>The {len(p.outcomes)} configurations, best first</h2>
<p>Ranked by whether the SLO holds, whether every request was served, then goodput per device (requests meeting
the latency targets per second, per device). <b>=</b>: equal to the chosen one within 1%.</p>
<table id="configurations"><thead><tr>{head}</tr></thead><tbody>
{body}
</tbody></table>
<h2>TTFT against TPOT</h2>
{_svg(p)}
<p>Green: SLO met; red: missed (hover a point for its configuration); blue line: the Pareto front among those that
met it; dashed: the SLO's bounds.</p>
</body></html>
"""


def write_outputs(p: Plan, out_dir: str | Path) -> tuple[Path, Path]:
    """plan.json, plan.html, and configs/NN.yaml: configuration NN's simulated spec (NN its rank),
    which `rerun_command` runs again."""
    import yaml

    from pdcluster.cluster.sim.plan import configure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if p.sim_base is not None:
        (out / "configs").mkdir(exist_ok=True)
        for i, o in enumerate(p.outcomes, 1):
            spec = configure(p.sim_base, o.config).model_dump(mode="json", exclude_defaults=True, exclude={"auth"})
            (out / "configs" / f"{i:02d}.yaml").write_text(f"# pdc plan's configuration {i}: {o.config.label}\n"
                                                           + yaml.safe_dump(spec, sort_keys=False))
    if p.twin is not None:
        write_outputs(p.twin, out / "twin")
    (out / "plan.json").write_text(to_json(p) + "\n")
    (out / "plan.html").write_text(render_html(p, out))
    return out / "plan.html", out / "plan.json"
