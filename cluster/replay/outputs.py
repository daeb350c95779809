"""What `pdc bench run` leaves behind and prints.

A run directory holds:
- summary.json: the config and one summary per phase, in seconds (field names
  carry their unit: `_s`, `_per_s`, `_tokens_per_s`; each stat says its unit);
- summary.csv: AISBench's table (metric rows x Average..P99, N), latencies in
  ms as AISBench prints them, one row per metric and phase; then the common
  metrics (throughputs, request counts, duration), one value each in Average;
- requests.jsonl: every request (warmup included, marked by `phase`) with its
  derived metrics and, when the router recorded a timeline for it, the
  server-side critical-path breakdown, so client and server views can be joined.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from pdcluster.cluster.replay.metrics import LATENCY_METRICS, METRICS, UNITS, PhaseSummary, Stats, per_request
from pdcluster.cluster.replay.records import RequestResult
from pdcluster.router.attribution import attribute, critical_path
from pdcluster.router.timeline import RequestRecord

CSV_HEADER = ["Performance Parameters", "Stage", "Average", "Min", "Max", "Median", "P75", "P90", "P99", "N", "Unit"]
_STAT_FIELDS = ("avg", "min", "max", "p50", "p75", "p90", "p99")
_NS_PER_MS = 1e6
MAX_FAILURES_SHOWN = 10


def _display(metric: str, value: float | None) -> float | None:
    """A stored value (seconds for latencies) in its display unit (ms for latencies)."""
    if value is None:
        return None
    return value * 1000 if metric in LATENCY_METRICS else value


def display_unit(metric: str) -> str:
    return "ms" if metric in LATENCY_METRICS else UNITS[metric]


def summary_dict(s: PhaseSummary) -> dict:
    d = asdict(s)
    d["stats"] = {m: {"unit": UNITS[m], **asdict(st)} for m, st in s.stats.items()}
    d["failures"] = [f._asdict() for f in s.failures]  # named fields, not bare JSON arrays
    return d


def timeline_join(rec: RequestRecord) -> dict:
    """The router's view of one request: the TTFT critical path in ms, and its cache/transfer tokens."""
    a = attribute(rec)
    return {
        "breakdown_ms": {part: ns / _NS_PER_MS for part, ns in a.parts_ns.items()},
        "server_ttft_ms": a.ttft_ns / _NS_PER_MS if a.ttft_ns is not None else None,
        "complete": a.complete,
        "stopped_after": a.stopped_after,
        "prefill_instance": rec.prefill_instance,
        "decode_instance": rec.decode_instance,
        "p_cached_tokens": rec.p_cached_tokens,
        "d_cached_tokens": rec.d_cached_tokens,
        "transferred_tokens": rec.transferred_tokens,
        "transfer_error": rec.transfer_error,
    }


def request_line(r: RequestResult, timelines: dict[str, RequestRecord] | None) -> dict:
    rec = timelines.get(r.request_id) if timelines and r.request_id is not None else None
    return {**asdict(r), "metrics": asdict(per_request(r)), "timeline": timeline_join(rec) if rec else None}


def write_run(out_dir: str | Path, results: Sequence[RequestResult], summaries: Iterable[PhaseSummary],
              config: dict, timelines: dict[str, RequestRecord] | None = None, slo=None) -> Path:
    """`slo`: goodput.py's SloFigures, if the run asked for them (summary.json's "slo")."""
    """Write summary.json, summary.csv and requests.jsonl into out_dir (created); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = list(summaries)

    doc = {
        "units": {"*_s": "seconds", "*_per_s": "per second", "stats": "each metric's own `unit`"},
        "config": config,
        "phases": {s.phase: summary_dict(s) for s in summaries},
        **({"slo": asdict(slo)} if slo is not None else {}),
    }
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")

    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_HEADER)
        for m in METRICS:  # metric-major, as AISBench's table: the phases of one metric side by side
            for s in summaries:
                st = s.stats[m]
                vals = [_display(m, getattr(st, k)) for k in _STAT_FIELDS]
                w.writerow([m, s.phase, *["" if v is None else round(v, 4) for v in vals], st.n, display_unit(m)])
        for s in summaries:  # then the common metrics, one value each (in the Average column)
            for label, value, unit in common_metrics(s):
                w.writerow([label, s.phase, "" if value is None else round(value, 4), *[""] * 7, unit])

    with open(out / "requests.jsonl", "w") as f:
        f.writelines(json.dumps(request_line(r, timelines), separators=(",", ":")) + "\n" for r in results)
    return out


def common_metrics(s: PhaseSummary) -> list[tuple[str, float | int | None, str]]:
    """AISBench's common metrics of a phase: (label, value in its display unit, unit)."""
    return [("Benchmark Duration", s.benchmark_duration_s * 1000, "ms"),
            ("Total Requests", s.total_requests, ""), ("Failed Requests", s.failed_requests, ""),
            ("Success Requests", s.success_requests, ""), ("Rejected Requests (429)", s.rejected_requests, ""),
            ("Concurrency", s.concurrency, ""), ("Max Concurrency", s.max_concurrency, ""),
            ("Request Throughput", s.request_throughput_per_s, "req/s"),
            ("Total Input Tokens", s.total_input_tokens, ""), ("Total Generated Tokens", s.total_generated_tokens, ""),
            ("Input Token Throughput", s.input_token_throughput_tokens_per_s, "token/s"),
            ("Output Token Throughput", s.output_token_throughput_tokens_per_s, "token/s"),
            ("Total Token Throughput", s.total_token_throughput_tokens_per_s, "token/s")]


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    # Fixed decimals, trailing zeros dropped: 500 ms, not 500.0000 ms (nan/inf print as such).
    text = f"{v:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _stat_row(metric: str, st: Stats) -> list[str]:
    unit = display_unit(metric)
    vals = [_fmt(_display(metric, getattr(st, k))) for k in _STAT_FIELDS]
    return [metric, *[v if v == "-" else f"{v} {unit}" for v in vals], str(st.n)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def format_summary(s: PhaseSummary) -> str:
    """AISBench-like terminal report of one phase: stats table, common metrics, cache hits, failures."""
    header = ["Performance Parameters", "Average", "Min", "Max", "Median", "P75", "P90", "P99", "N"]
    parts = [f"== phase: {s.phase} ==", _table(header, [_stat_row(m, s.stats[m]) for m in METRICS]), ""]

    common = []
    for label, value, unit in common_metrics(s):
        text = _fmt(value) + (f" {unit}" if unit else "")
        if label == "Rejected Requests (429)":
            text += f" ({s.rejections} 429s in all)"
        common.append([label, text])
    parts.append(_table(["Common Metric", "Value"], common))
    parts.append("")
    parts.append(f"Prefix cache hit ratio: measured {_pct(s.measured_hit_ratio)} ({s.measured_hit_requests} requests)"
                 f" | expected {_pct(s.expected_hit_ratio)} ({s.expected_hit_requests} requests)"
                 f" | cached != expected: {s.cache_mismatches}")
    if s.failures:
        parts.append(f"Failures: {len(s.failures)}")
        for f in s.failures[:MAX_FAILURES_SHOWN]:
            parts.append(f"  #{f.index} {f.request_id or '-'}: {f.error}")
        if len(s.failures) > MAX_FAILURES_SHOWN:
            parts.append(f"  ... and {len(s.failures) - MAX_FAILURES_SHOWN} more (see requests.jsonl)")
    return "\n".join(parts)


def format_phase_breakdown(records: Iterable[RequestRecord]) -> str:
    """Mean ms and share of each critical-path part over the joined requests.

    Only records whose critical path is complete count: a partial one (a failed
    request, a missing event) would make the parts' means not add up to the
    mean server TTFT, and the shares would not sum to 100%.
    """
    attrs = [attribute(r) for r in records]
    done = [a for a in attrs if a.complete]
    if not done:
        return f"Server-side TTFT breakdown: no complete timelines ({len(attrs)} joined)"
    means = {p: sum(a.parts_ns.get(p, 0) for a in done) / len(done) / _NS_PER_MS for p in critical_path(done)}
    total = sum(means.values())
    rows = [[p, _fmt(ms, 3), _pct(ms / total if total else None)] for p, ms in means.items()]
    rows.append(["TTFT (server)", _fmt(total, 3), _pct(1.0 if total else None)])
    head = f"Server-side TTFT breakdown over {len(done)} requests"
    if len(done) < len(attrs):
        head += f" ({len(attrs) - len(done)} incomplete skipped)"
    return head + "\n" + _table(["Part", "Mean ms", "Share"], rows)
