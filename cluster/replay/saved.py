"""Saved replay results, read back: `pdc bench show DIR` prints a run's tables as `pdc bench run`
printed them; `pdc bench compare A B ...` sets the formal windows side by side, each run beside the
first as a ratio. Both read DIR/summary.json (cluster/replay/outputs.py writes it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from pdcluster.cluster.replay.metrics import Failure, PhaseSummary, Stats
from pdcluster.cluster.replay.outputs import _display, display_unit, format_summary

# compare's rows: (metric, stat) pairs, then the phase's own figures.
COMPARED = (("TTFT", "avg"), ("TTFT", "p50"), ("TTFT", "p90"), ("TTFT", "p99"), ("TPOT", "avg"), ("TPOT", "p90"),
            ("TPOT", "p99"), ("ITL", "p50"), ("ITL", "p99"), ("E2EL", "avg"), ("E2EL", "p90"))
COMMON = (("request_throughput_per_s", "Request Throughput", "req/s"),
          ("output_token_throughput_tokens_per_s", "Output Token Throughput", "token/s"),
          ("measured_hit_ratio", "Prefix cache hit", ""), ("failed_requests", "Failed Requests", ""),
          ("rejected_requests", "Rejected Requests (429)", ""))


@dataclass(frozen=True)
class SavedRun:
    path: Path
    config: dict
    phases: dict[str, PhaseSummary]

    @property
    def main_phase(self) -> PhaseSummary:
        """The formal window, or the last phase (a load without phases)."""
        return self.phases.get("formal") or next(reversed(self.phases.values()))


def load_saved(path: str | Path) -> SavedRun:
    """A `pdc bench run` (or `pdc sim run`) output directory; ValueError naming what is wrong."""
    path = Path(path)
    doc_path = path / "summary.json"
    if not doc_path.is_file():
        raise ValueError(f"{path}: not a bench result directory (no summary.json; pdc bench run --out writes one)")
    try:
        doc = json.loads(doc_path.read_text())
        phases = {name: _phase(d) for name, d in doc["phases"].items()}
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{doc_path}: not a summary pdc bench run wrote ({err!r})") from None
    if not phases:
        raise ValueError(f"{doc_path}: no phase in it")
    return SavedRun(path, doc.get("config") or {}, phases)


def _phase(d: dict) -> PhaseSummary:
    stat_fields = {f.name for f in fields(Stats)}
    stats = {m: Stats(**{k: v for k, v in st.items() if k in stat_fields}) for m, st in d["stats"].items()}
    failures = [Failure(**f) for f in d.get("failures", [])]
    known = {f.name for f in fields(PhaseSummary)}
    return PhaseSummary(**{**{k: v for k, v in d.items() if k in known}, "stats": stats, "failures": failures})


def show(run: SavedRun, phase: str | None = None) -> str:
    """The phase's table (default: the formal window, after a line per other phase)."""
    if phase is not None:
        if phase not in run.phases:
            raise ValueError(f"--phase {phase}: {run.path} has {', '.join(run.phases)}")
        return format_summary(run.phases[phase])
    main = run.main_phase
    lines = [f"{p.phase} phase: {p.success_requests}/{p.total_requests} ok in {p.benchmark_duration_s or 0:.1f} s"
             for p in run.phases.values() if p is not main]
    return "\n".join([f"{run.path}: {_describe(run.config)}", *lines, format_summary(main)])


def _describe(config: dict) -> str:
    load = config.get("preset") or (Path(config["trace"]).name if config.get("trace") else "synthetic")
    return (f"{load}, {config.get('num_requests') or 'all'} requests, at most {config.get('max_concurrency') or 'any'} "
            f"in flight, {config.get('request_rate') or 'no'} req/s cap, seed {config.get('seed')}")


def compare(runs: list[SavedRun]) -> str:
    """Each run's formal window (else last phase) side by side; from the second on, its ratio to
    the first (`x1.12`: 12% higher)."""
    assert len(runs) >= 2, "compare needs two runs at least"
    mains = [r.main_phase for r in runs]
    header = ["metric", *[f"[{k}] {r.path.name}" for k, r in enumerate(runs, 1)]]
    rows = []
    for metric, stat in COMPARED:
        vals = [_display(metric, getattr(m.stats[metric], stat)) if metric in m.stats else None for m in mains]
        rows.append([f"{metric} {'mean' if stat == 'avg' else stat} ({display_unit(metric)})",
                     *_with_ratios(vals, "{:,.2f}")])
    for attr, name, unit in COMMON:
        vals = [getattr(m, attr) for m in mains]
        fmt = "{:.2%}" if attr == "measured_hit_ratio" else "{:,.3f}" if unit else "{:,.0f}"
        rows.append([f"{name}{f' ({unit})' if unit else ''}", *_with_ratios(vals, fmt)])
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    out = ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip()
           for r in [header, *rows]]
    out.insert(1, "  ".join("-" * w for w in widths))
    phases = {m.phase for m in mains}
    legend = [f"[{k}] {r.path}: {r.main_phase.phase} phase, {_describe(r.config)}" for k, r in enumerate(runs, 1)]
    note = [] if phases == {"formal"} else ["note: not every run has a formal window; the last phase is compared"]
    return "\n".join([*out, "", *legend, *note])


def _with_ratios(vals: list[float | None], fmt: str) -> list[str]:
    first = vals[0]
    cells = []
    for k, v in enumerate(vals):
        text = "-" if v is None else fmt.format(v)
        if k and v is not None and first:
            text += f" (x{v / first:.2f})"
        cells.append(text)
    return cells
