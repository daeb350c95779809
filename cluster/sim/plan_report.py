"""A plan (cluster/sim/plan.py) as a terminal table, JSON, and a self-contained HTML page: the
table, and the Pareto plot of TTFT against TPOT (at the SLO's percentile) of every configuration,
the SLO's bounds drawn, the chosen one marked. Inline SVG and CSS only: no script, nothing fetched.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from pdcluster.cluster.sim.plan import MISS, Outcome, Plan, decided_by, pareto, pname, tied


def _ms(v: float | None) -> str:
    """A latency in ms; "miss" where the percentile falls on refused or failed requests."""
    return "-" if v is None else "miss" if v == MISS else f"{v * 1e3:,.1f}"


def rows(p: Plan) -> list[list[str]]:
    q = pname(p.slo.percentile)
    header = ["#", "", "P:D", "budget", "seqs", "policy", "cap", f"TTFT {q} ms", f"TPOT {q} ms", "E2E mean ms",
              "req/s", "goodput/dev", "refused", "SLO"]
    out = [header]
    for i, o in enumerate(p.outcomes, 1):
        c = o.config
        mark = "=" if i > 1 and tied(p.chosen, o) else ""  # nothing measured tells it from the chosen one
        out.append([str(i), mark, f"{c.prefill}:{c.decode}", str(c.max_num_batched_tokens), str(c.max_num_seqs), c.policy,
                    str(c.max_in_flight or "-"), _ms(o.ttft_s), _ms(o.tpot_s), _ms(o.e2e_mean_s),
                    f"{o.throughput:.2f}", f"{o.goodput_per_device:.3f}", str(o.failed),
                    "met" if o.slo_met else "missed"])
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
        d = dataclasses.asdict(o) | {"label": o.config.label}
        return {k: None if v == MISS else v for k, v in d.items()}
    provenance = dataclasses.asdict(p.provenance) if p.provenance else None
    return json.dumps({"devices": p.devices, "workload": p.workload, "slo": dataclasses.asdict(p.slo),
                       "provenance": provenance, "chosen": outcome(p.chosen), "decided_by": decided_by(p),
                       "tied_with_chosen": [o.config.label for o in p.outcomes[1:] if tied(p.chosen, o)],
                       "configurations": [outcome(o) for o in p.outcomes]}, indent=1)


def provenance_lines(p: Plan) -> list[str]:
    """What the answer rests on (plan.Provenance), a line each; a plan made by hand says so."""
    return p.provenance.lines() if p.provenance else ["model: not recorded (a plan made by hand)"]


W, H, PAD = 760, 460, 64


def _svg(p: Plan) -> str:
    pts = [o for o in p.outcomes if o.measured]
    if not pts:
        return "<p>No configuration finished a request: nothing to plot.</p>"
    xs = [o.ttft_s for o in pts] + ([p.slo.ttft_s] if p.slo.ttft_s else [])
    ys = [o.tpot_s for o in pts] + ([p.slo.tpot_s] if p.slo.tpot_s else [])
    x1, y1 = max(xs) * 1.08, max(ys) * 1.08

    def x(v: float) -> float:
        return PAD + v / x1 * (W - 2 * PAD)

    def y(v: float) -> float:
        return H - PAD - v / y1 * (H - 2 * PAD)

    q = pname(p.slo.percentile)
    parts = [f'<svg id="pareto" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" role="img" aria-label="TTFT against TPOT per configuration">',
             f'<rect x="{PAD}" y="{PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" class="frame"/>']
    for k in range(6):  # ticks
        tx, ty = x1 * k / 5, y1 * k / 5
        parts.append(f'<text x="{x(tx):.1f}" y="{H - PAD + 18}" class="tick">{tx:.2f}</text>')
        parts.append(f'<text x="{PAD - 8}" y="{y(ty) + 4:.1f}" class="tick end">{ty * 1e3:.1f}</text>')
    parts.append(f'<text x="{W / 2}" y="{H - 16}" class="axis">TTFT {q} (s)</text>')
    parts.append(f'<text x="18" y="{H / 2}" class="axis" transform="rotate(-90 18 {H / 2})">TPOT {q} (ms)</text>')
    if p.slo.ttft_s:
        parts.append(f'<line x1="{x(p.slo.ttft_s):.1f}" y1="{PAD}" x2="{x(p.slo.ttft_s):.1f}" y2="{H - PAD}" '
                     f'class="slo"/>')
    if p.slo.tpot_s:
        parts.append(f'<line x1="{PAD}" y1="{y(p.slo.tpot_s):.1f}" x2="{W - PAD}" y2="{y(p.slo.tpot_s):.1f}" '
                     f'class="slo"/>')
    front = pareto(pts)
    if len(front) > 1:
        path = " ".join(f"{x(o.ttft_s):.1f},{y(o.tpot_s):.1f}" for o in front)
        parts.append(f'<polyline points="{path}" class="front"/>')
    for o in pts:
        cls = "met" if o.slo_met else "missed"
        tip = html.escape(f"{o.config.label}: TTFT {q} {o.ttft_s:.3f} s, TPOT {q} {o.tpot_s * 1e3:.2f} ms, "
                          f"goodput {o.goodput_per_device:.3f} req/s/device")
        parts.append(f'<circle cx="{x(o.ttft_s):.1f}" cy="{y(o.tpot_s):.1f}" r="5" class="point {cls}">'
                     f'<title>{tip}</title></circle>')
    c = p.chosen
    if c in pts:
        parts.append(f'<circle id="chosen" cx="{x(c.ttft_s):.1f}" cy="{y(c.tpot_s):.1f}" r="11" class="chosen"/>')
        parts.append(f'<text x="{x(c.ttft_s) + 14:.1f}" y="{y(c.tpot_s) - 10:.1f}" class="label">chosen: '
                     f'P{c.config.prefill}:D{c.config.decode}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin-top: 16px; }
td, th { padding: 3px 8px; border-bottom: 1px solid #ddd; text-align: right; }
tr.chosen td { background: #fff5cc; font-weight: 600; }
#provenance { background: #f4f4f4; padding: 8px 12px; white-space: pre-wrap; }
.frame { fill: none; stroke: #999; }
.tick { font-size: 11px; fill: #555; text-anchor: middle; } .tick.end { text-anchor: end; }
.axis { font-size: 13px; text-anchor: middle; fill: #222; }
.slo { stroke: #c33; stroke-dasharray: 6 4; }
.front { fill: none; stroke: #36c; stroke-width: 1.5; }
.point.met { fill: #2a8a3e; } .point.missed { fill: #c44; opacity: 0.7; }
.chosen { fill: none; stroke: #e6a100; stroke-width: 3; }
.label { font-size: 12px; font-weight: 600; fill: #8a6000; }
"""


def render_html(p: Plan) -> str:
    table = rows(p)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table[0])
    body = "\n".join(f'<tr{" class=chosen" if i == 0 else ""}>'
                     + "".join(f"<td>{html.escape(cell)}</td>" for cell in r) + "</tr>"
                     for i, r in enumerate(table[1:]))
    c = p.chosen
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pdc plan: {html.escape(p.workload)} on {p.devices} devices</title>
<style>{CSS}</style></head><body>
<h1>pdc plan: {html.escape(p.workload)} on {p.devices} devices</h1>
<p>SLO: {html.escape(slo_text(p))}. {len(p.outcomes)} configurations on the virtual clock, ranked by whether the
SLO holds, then goodput per device (requests meeting the latency targets per second, per device).</p>
<pre id="provenance">{html.escape(chr(10).join(provenance_lines(p)))}</pre>
<p id="chosen-text">Chosen: <b>{html.escape(c.config.label)}</b> — SLO {"met" if c.slo_met else "missed"},
goodput {c.goodput_per_device:.3f} req/s per device. Decided by {html.escape(decided_by(p))}.</p>
{_svg(p)}
<p>Green: SLO met; red: missed; blue line: the Pareto front; dashed: the SLO's bounds.</p>
<table id="configurations"><thead><tr>{head}</tr></thead><tbody>
{body}
</tbody></table>
</body></html>
"""


def write_outputs(p: Plan, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(to_json(p) + "\n")
    (out / "plan.html").write_text(render_html(p))
    return out / "plan.html", out / "plan.json"
