"""Export a run as Chrome/Perfetto trace-event JSON (open it in ui.perfetto.dev or chrome://tracing).

Layout: one process per instance (the router, each P, each D), one thread per
request within each process, one B/E slice per phase interval on the process
where the phase runs (the KV pull on the decode instance that pulls), and a
flow arrow from each request's prefill slice to its first decode-side slice.
Timestamps are microseconds since the run's first arrival, on the router clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdcluster.router.attribution import Interval, intervals
from pdcluster.router.run_store import Run
from pdcluster.router.timeline import RequestRecord
from pdcluster.router.timeline_views import run_origin_ns

ROUTER = "router"
FLOW_CAT = "kv_handoff"
_META_NAMES = {"process_name": "name", "thread_name": "name", "process_labels": "labels",
               "process_sort_index": "sort_index", "thread_sort_index": "sort_index"}
_REQUIRED = {"B": ("name", "ts", "pid", "tid"), "E": ("ts", "pid", "tid"), "X": ("name", "ts", "dur", "pid", "tid"),
             "i": ("name", "ts", "pid", "tid"), "s": ("name", "cat", "id", "ts", "pid", "tid"),
             "f": ("name", "cat", "id", "ts", "pid", "tid"), "M": ("name", "pid", "args")}


@dataclass
class _Process:
    pid: int
    name: str
    role: str
    tids: dict[tuple[str, int], int]  # (request id, lane) -> tid


@dataclass
class _Slice:
    iv: Interval
    pid: int
    tid: int


def _instance_of(rec: RequestRecord, iv: Interval) -> tuple[str, str]:
    """(instance name, role) of the process a phase runs on; the KV pull runs on the D that pulls."""
    if iv.where == "router":
        return ROUTER, "router"
    if iv.where == "prefill":
        return rec.prefill_instance or "unknown prefill", "prefill"
    return rec.decode_instance or "unknown decode", "decode"


def _lanes(ivs: list[Interval]) -> list[list[Interval]]:
    """Split one request's slices on one process into lanes of disjoint slices.

    In-order events give one lane; out-of-order ones (a clock bug) could make
    partly overlapping slices, which B/E on one thread cannot express.
    """
    lanes: list[list[Interval]] = []
    for iv in sorted(ivs, key=lambda i: (i.start_ns, i.end_ns)):
        lane = next((ln for ln in lanes if ln[-1].end_ns <= iv.start_ns), None)
        if lane is None:
            lanes.append(lane := [])
        lane.append(iv)
    return lanes


def _slices(rec: RequestRecord, procs: dict[str, _Process]) -> list[_Slice]:
    per_proc: dict[str, list[Interval]] = {}
    for iv in intervals(rec):
        name, role = _instance_of(rec, iv)
        procs.setdefault(name, _Process(len(procs) + 1, name, role, {}))
        # A negative interval (events out of order) is drawn empty at its start; args say by how much.
        per_proc.setdefault(name, []).append(iv if iv.end_ns >= iv.start_ns else
                                             Interval(iv.name, iv.where, iv.start_ns, iv.start_ns))
    out = []
    for name, ivs in per_proc.items():
        proc = procs[name]
        for lane_no, lane in enumerate(_lanes(ivs)):
            tid = proc.tids.setdefault((rec.request_id, lane_no), len(proc.tids) + 1)
            out += [_Slice(iv, proc.pid, tid) for iv in lane]
    return out


def to_trace_events(run: Run) -> dict:
    t0 = run_origin_ns(run)

    def us(ns: int) -> float:
        return round((ns - t0) / 1000, 3)  # keeps ns precision

    procs: dict[str, _Process] = {ROUTER: _Process(1, ROUTER, "router", {})}
    for inst in run.meta.instances:
        procs.setdefault(inst.name, _Process(len(procs) + 1, inst.name, inst.role, {}))
    events: list[dict] = []
    for flow_id, rec in enumerate(run.records, 1):
        slices = _slices(rec, procs)
        negative = {iv.name: iv.start_ns - iv.end_ns for iv in intervals(rec) if iv.end_ns < iv.start_ns}
        p_side = [s for s in slices if s.iv.where == "prefill"]
        d_side = [s for s in slices if s.iv.where in ("decode", "transfer")]
        src = next((s for s in p_side if s.iv.name == "prefill"), p_side[-1] if p_side else None)
        dst = min(d_side, key=lambda s: s.iv.start_ns) if d_side else None
        args = {"request_id": rec.request_id, "prompt_tokens": rec.prompt_tokens, "output_tokens": rec.output_tokens,
                "p_cached_tokens": rec.p_cached_tokens, "d_cached_tokens": rec.d_cached_tokens,
                "transferred_tokens": rec.transferred_tokens}
        for s in slices:
            a = dict(args, phase=s.iv.name)
            if s.iv.name == "transfer":
                a["bytes_per_group"] = {str(g.group): g.bytes for g in rec.transfer_groups}
            if s.iv.name in negative:
                a["out_of_order_ns"] = negative[s.iv.name]
            where = {"cat": s.iv.where, "pid": s.pid, "tid": s.tid}
            b, e = us(s.iv.start_ns), us(s.iv.end_ns)
            events.append({"name": s.iv.name, "ph": "B", "ts": b, **where, "args": a})
            if src and dst and (s is src or s is dst):
                # Mid-slice, between its B and E: binds to this slice, not to a neighbour touching it.
                flow = {"name": "kv handoff", "cat": FLOW_CAT, "id": flow_id, "ph": "s" if s is src else "f",
                        "ts": round((b + e) / 2, 3), "pid": s.pid, "tid": s.tid, "args": {"request_id": rec.request_id}}
                if s is dst:
                    flow["bp"] = "e"
                events.append(flow)
            events.append({"name": s.iv.name, "ph": "E", "ts": e, **where})
    meta: list[dict] = []
    for p in procs.values():
        meta += [{"name": "process_name", "ph": "M", "pid": p.pid, "tid": 0, "args": {"name": f"{p.name} ({p.role})"}},
                 {"name": "process_sort_index", "ph": "M", "pid": p.pid, "tid": 0, "args": {"sort_index": p.pid}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": p.pid, "tid": tid,
                  "args": {"name": req if lane == 0 else f"{req} ({lane + 1})"}} for (req, lane), tid in p.tids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "metadata": {"run_id": run.meta.run_id, "clock": "router monotonic; ts in us since the first arrival",
                         "origin_router_ns": t0, "started_wall_ns": run.meta.started_wall_ns,
                         "started_mono_ns": run.meta.started_mono_ns, "versions": run.meta.versions}}


def write_trace(run: Run, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_trace_events(run)))
    return path


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def validate_trace(trace: object) -> list[str]:
    """Problems with a trace in the JSON Object Format (empty if none)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    problems: list[str] = []
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {trace['displayTimeUnit']!r} is not 'ms' or 'ns'")
    open_: dict[tuple, list[dict]] = {}  # (pid, tid) -> stack of open B events
    slices: dict[tuple, list[tuple[float, float]]] = {}
    last_ts: dict[tuple, float] = {}
    flows: dict[tuple, list[dict]] = {}
    named: set[int] = set()
    for i, ev in enumerate(trace["traceEvents"]):
        where = f"event {i}"
        if not isinstance(ev, dict) or "ph" not in ev:
            problems.append(f"{where}: not an object with a 'ph'")
            continue
        ph = ev["ph"]
        if ph not in _REQUIRED:
            problems.append(f"{where}: unsupported ph {ph!r}")
            continue
        if missing := [k for k in _REQUIRED[ph] if k not in ev]:
            problems.append(f"{where} ({ph}): missing {', '.join(missing)}")
            continue
        if ph == "M":
            key = _META_NAMES.get(ev["name"])
            if key is None or not isinstance(ev["args"], dict) or key not in ev["args"]:
                problems.append(f"{where}: metadata {ev['name']!r} needs args.{key or '<known name>'}")
            elif ev["name"] == "thread_name" and "tid" not in ev:
                problems.append(f"{where}: thread_name without tid")
            elif ev["name"] == "process_name":
                named.add(ev["pid"])
            continue
        if not _is_num(ev["ts"]) or not all(isinstance(ev[k], int) for k in ("pid", "tid")):
            problems.append(f"{where} ({ph}): ts must be a number, pid and tid integers")
            continue
        key = (ev["pid"], ev["tid"])
        if ev["ts"] < last_ts.get(key, float("-inf")):
            problems.append(f"{where} ({ph}): ts {ev['ts']} goes back in time on pid {key[0]} tid {key[1]}")
        last_ts[key] = max(ev["ts"], last_ts.get(key, float("-inf")))
        stack = open_.setdefault(key, [])
        if ph == "B":
            stack.append(ev)
        elif ph == "E":
            if not stack:
                problems.append(f"{where}: E on pid {key[0]} tid {key[1]} with no open B")
                continue
            b = stack.pop()
            if ev["ts"] < b["ts"]:
                problems.append(f"{where}: E at {ev['ts']} before its B {b['name']!r} at {b['ts']}")
            if "name" in ev and ev["name"] != b["name"]:
                problems.append(f"{where}: E {ev['name']!r} closes B {b['name']!r} (not nested)")
            slices.setdefault(key, []).append((b["ts"], ev["ts"]))
        elif ph == "X":
            if not _is_num(ev["dur"]) or ev["dur"] < 0:
                problems.append(f"{where}: X with negative or non-numeric dur")
            else:
                slices.setdefault(key, []).append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ph in ("s", "f"):
            flows.setdefault((ev["cat"], ev["id"]), []).append(ev)
    for (pid, tid), stack in open_.items():
        problems += [f"B {b['name']!r} on pid {pid} tid {tid} at {b['ts']} is never closed" for b in stack]
    for (cat, fid), evs in flows.items():
        phs = sorted(e["ph"] for e in evs)
        if phs != ["f", "s"]:
            problems.append(f"flow {cat}/{fid}: has {phs}, needs exactly one 's' and one 'f'")
        for e in evs:
            if not any(a <= e["ts"] <= b for a, b in slices.get((e["pid"], e["tid"]), [])):
                problems.append(f"flow {cat}/{fid}: {e['ph']!r} at {e['ts']} is inside no slice")
    used = {pid for pid, _ in slices}
    problems += [f"pid {pid} has slices but no process_name" for pid in sorted(used - named)]
    return problems
