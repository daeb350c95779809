"""Export a run as Chrome/Perfetto trace-event JSON (open it in ui.perfetto.dev or chrome://tracing).

Layout, as a timeline of a serving system is read: one process (track) per instance, the router,
each P and each D, and on it the requests it worked on, each a slice named by its request id,
holding its phase slices on that instance (the KV pull on the D that pulls). Requests that overlap
in time on one instance go on sub-tracks ("lane k", threads of its process): an instance has as
many lanes as it had requests at once, not one per request. A flow arrow per request goes forward
in time from P's KV being ready (the end of its prefill; with a push, where D began loading while P
computed) to D's load of it (its transfer, else its first step on D). Timestamps are microseconds
since the run's first arrival, on the router clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
_NUDGE_NS = 1000  # a flow point this far inside its slice's end, so that it binds to that slice


@dataclass
class _Process:
    pid: int
    name: str
    role: str
    lane_ends: list[int] = field(default_factory=list)  # per lane: where its last request ended (ns)


@dataclass
class _Stay:
    """One request on one instance: its phases there, in order, none overlapping."""

    rec: RequestRecord
    proc: _Process
    phases: list[Interval]
    clipped: dict[str, int]  # phase -> ns it was shortened by (events out of order)
    lane: int = 0

    @property
    def start_ns(self) -> int:
        return self.phases[0].start_ns

    @property
    def end_ns(self) -> int:
        return self.phases[-1].end_ns


def _instance_of(rec: RequestRecord, iv: Interval) -> tuple[str, str]:
    """(instance name, role) of the process a phase runs on; the KV pull runs on the D that pulls."""
    if iv.where == "router":
        return ROUTER, "router"
    if iv.where == "prefill":
        return rec.prefill_instance or "unknown prefill", "prefill"
    return rec.decode_instance or "unknown decode", "decode"


def _stays(rec: RequestRecord, procs: dict[str, _Process]) -> list[_Stay]:
    per: dict[str, list[Interval]] = {}
    for iv in intervals(rec):
        name, role = _instance_of(rec, iv)
        procs.setdefault(name, _Process(len(procs) + 1, name, role))
        per.setdefault(name, []).append(iv)
    out = []
    for name, ivs in per.items():
        phases, clipped = [], {}
        for iv in sorted(ivs, key=lambda i: (i.start_ns, i.end_ns)):
            # Slices on one track nest or follow: a phase that starts (or ends) before the one
            # before it ended (events out of order) is shortened to fit, and says by how much.
            start = max(iv.start_ns, phases[-1].end_ns) if phases else iv.start_ns
            end = max(iv.end_ns, start)
            if (start, end) != (iv.start_ns, iv.end_ns):
                clipped[iv.name] = (start - iv.start_ns) + max(0, iv.start_ns - iv.end_ns)
            phases.append(Interval(iv.name, iv.where, start, end))
        out.append(_Stay(rec, procs[name], phases, clipped))
    return out


def _assign_lanes(stays: list[_Stay]) -> None:
    """Each stay on the first lane of its instance free when it starts (in order of start)."""
    for st in sorted(stays, key=lambda s: (s.start_ns, s.end_ns)):
        ends = st.proc.lane_ends
        st.lane = next((k for k, end in enumerate(ends) if end <= st.start_ns), len(ends))
        if st.lane == len(ends):
            ends.append(st.end_ns)
        else:
            ends[st.lane] = st.end_ns


def _inside(iv: Interval, ts_ns: int) -> int | None:
    """ts moved inside the slice, off its end (None if the slice has no inside)."""
    if iv.end_ns <= iv.start_ns:
        return None
    return min(max(ts_ns, iv.start_ns), iv.end_ns - min(_NUDGE_NS, (iv.end_ns - iv.start_ns) // 2))


def _flow(rec: RequestRecord, stays: list[_Stay]) -> tuple[tuple[_Stay, int, int], tuple[_Stay, int, int]] | None:
    """((P's stay, phase index, ns), (D's stay, phase index, ns)) of the request's KV handoff
    arrow, forward in time; None if it has no prefill on P or never reached D."""
    p = next((s for s in stays if s.proc.role == "prefill"), None)
    d = next((s for s in stays if s.proc.role == "decode"), None)
    k = next((k for k, iv in enumerate(p.phases if p else []) if iv.name == "prefill"), None)
    if k is None or d is None:
        return None
    prefill, ev = p.phases[k], rec.events
    ready = prefill.end_ns
    if "transfer_start" in ev and ev["transfer_start"] < prefill.end_ns:  # a push: D loads while P computes
        ready = ev["transfer_start"]
    src = _inside(prefill, ready)
    if src is None:
        return None
    # D's load: its transfer, else (D held the prompt, or no transfer was timed) its first phase
    # still running then.
    order = sorted(range(len(d.phases)), key=lambda j: (d.phases[j].name != "transfer", j))
    for j in order:
        iv = d.phases[j]
        if iv.end_ns > src:
            dst = _inside(iv, max(iv.start_ns, src))
            if dst is not None and dst >= src:
                return (p, k, src), (d, j, dst)
    return None


def to_trace_events(run: Run) -> dict:
    t0 = run_origin_ns(run)

    def us(ns: int) -> float:
        return round((ns - t0) / 1000, 3)  # keeps ns precision

    procs: dict[str, _Process] = {ROUTER: _Process(1, ROUTER, "router")}
    for inst in run.meta.instances:
        procs.setdefault(inst.name, _Process(len(procs) + 1, inst.name, inst.role))
    per_request = [(rec, _stays(rec, procs)) for rec in run.records]
    _assign_lanes([st for _, stays in per_request for st in stays])
    flows: dict[tuple[int, int], list[dict]] = {}  # (id(stay), phase index) -> its flow events, ts in ns
    for flow_id, (rec, stays) in enumerate(per_request, 1):
        for (st, k, ns), ph in zip(_flow(rec, stays) or (), ("s", "f")):
            event = {"name": "kv handoff", "cat": FLOW_CAT, "id": flow_id, "ph": ph, "pid": st.proc.pid,
                     "tid": st.lane + 1, "ts": ns, "args": {"request_id": rec.request_id}}
            if ph == "f":
                event["bp"] = "e"  # binds to the slice enclosing it
            flows.setdefault((id(st), k), []).append(event)
    # A lane's requests follow one another and a request's phases one another: written in order,
    # its events nest and never go back in time.
    by_lane: dict[tuple[int, int], list[_Stay]] = {}
    for _, stays in per_request:
        for st in stays:
            by_lane.setdefault((st.proc.pid, st.lane + 1), []).append(st)
    events: list[dict] = []
    for (pid, tid), lane in sorted(by_lane.items()):
        where = {"pid": pid, "tid": tid}
        for st in sorted(lane, key=lambda s: (s.start_ns, s.end_ns)):
            rec = st.rec
            args = {"request_id": rec.request_id, "prompt_tokens": rec.prompt_tokens,
                    "output_tokens": rec.output_tokens, "p_cached_tokens": rec.p_cached_tokens,
                    "d_cached_tokens": rec.d_cached_tokens, "transferred_tokens": rec.transferred_tokens}
            events.append({"name": rec.request_id, "ph": "B", "cat": "request", "ts": us(st.start_ns), **where,
                           "args": dict(args, phases=[iv.name for iv in st.phases])})
            for k, iv in enumerate(st.phases):
                a = dict(args, phase=iv.name)
                if iv.name == "transfer":
                    a["bytes_per_group"] = {g.label: g.bytes for g in rec.transfer_groups}
                if iv.name in st.clipped:
                    a["out_of_order_ns"] = st.clipped[iv.name]
                events.append({"name": iv.name, "ph": "B", "cat": iv.where, "ts": us(iv.start_ns), **where, "args": a})
                events += [{**f, "ts": us(f["ts"])} for f in flows.get((id(st), k), [])]
                events.append({"name": iv.name, "ph": "E", "ts": us(iv.end_ns), **where})
            events.append({"name": rec.request_id, "ph": "E", "ts": us(st.end_ns), **where})
    meta: list[dict] = []
    for p in procs.values():
        meta += [{"name": "process_name", "ph": "M", "pid": p.pid, "tid": 0, "args": {"name": f"{p.name} ({p.role})"}},
                 {"name": "process_sort_index", "ph": "M", "pid": p.pid, "tid": 0, "args": {"sort_index": p.pid}}]
        meta += [m for k in range(len(p.lane_ends)) for m in (
            {"name": "thread_name", "ph": "M", "pid": p.pid, "tid": k + 1, "args": {"name": f"lane {k + 1}"}},
            {"name": "thread_sort_index", "ph": "M", "pid": p.pid, "tid": k + 1, "args": {"sort_index": k + 1}})]
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
