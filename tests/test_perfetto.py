"""Perfetto export of the sample run, and validate_trace on deliberately broken traces."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest
from test_timeline_views import make_record, write_run

from pdcluster.router.perfetto import to_trace_events, validate_trace, write_trace
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline_cli import add_timeline_commands


@pytest.fixture
def run(tmp_path):
    return load_run(write_run(tmp_path / "run"))


def test_export_is_valid_and_round_trips(run, tmp_path):
    trace = to_trace_events(run)
    assert validate_trace(trace) == []
    path = write_trace(run, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == trace
    assert trace["displayTimeUnit"] == "ms" and trace["metadata"]["run_id"] == "run-test"


def test_one_track_per_instance_with_a_lane_per_request_running_at_once(run):
    """Issue 28 item 3: a process per instance, its requests as slices on it, requests that
    overlap in time on sub-tracks (lanes), not a thread per request."""
    events = to_trace_events(run)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["D0 (decode)", "P0 (prefill)", "P1 (prefill)", "router (router)"]
    pid = {v.split()[0]: k for k, v in names.items()}
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    requests = {(e["pid"], e["tid"], e["name"]) for e in events if e["ph"] == "B" and e.get("cat") == "request"}
    # P0: r1 (2-24 ms) and r3 (21-32 ms) overlap: two lanes. r5 failed before P0 scheduled it.
    assert {(t, r) for p, t, r in requests if p == pid["P0"]} == {(1, "r1"), (2, "r3")}
    assert {n for p, n in lanes if p == pid["P0"]} == {"lane 1", "lane 2"}
    # The router's part of each (arrival to P's queue, then D's first token to the client's): r1
    # 0-40, r2 10-70, r3 20-40, r4 30-32 (failed on D), r5 40-41: four at once at 30 ms, four lanes.
    assert {r for p, _, r in requests if p == pid["router"]} == {"r1", "r2", "r3", "r4", "r5"}
    assert len({n for p, n in lanes if p == pid["router"]}) == 4
    # A request's phases nest in its slice: r2's on D0 are inside [its first, its last].
    d0 = [e for e in events if e["pid"] == pid["D0"] and e.get("args", {}).get("request_id") == "r2" and e["ph"] == "B"]
    outer, inner = d0[0], d0[1:]
    assert outer["name"] == "r2" and outer["args"]["phases"] == [e["name"] for e in inner if e.get("cat") != "request"]


def test_slices_and_timestamps(run):
    events = to_trace_events(run)["traceEvents"]
    ph = Counter(e["ph"] for e in events)
    # The phases of r1..r5 (11, 11, 11, 6, 1), and each request once per instance it was on (3, 3, 3, 3, 1).
    assert ph["B"] == ph["E"] == 11 + 11 + 11 + 6 + 1 + 3 + 3 + 3 + 3 + 1
    prefill = next(e for e in events if e["ph"] == "B" and e["name"] == "prefill" and e["args"]["request_id"] == "r2")
    assert prefill["ts"] == 20_000.0  # us since the first arrival (r1 at T)
    assert prefill["args"]["prompt_tokens"] == 300 and prefill["args"]["p_cached_tokens"] == 100
    transfer = next(e for e in events if e["ph"] == "B" and e["name"] == "transfer" and e["args"]["request_id"] == "r1")
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[transfer["pid"]] == "D0 (decode)"  # the pull is drawn on the D that pulls
    assert transfer["args"]["bytes_per_group"] == {"group 0 (swa_kv)": 1000, "group 1": 500}


def test_one_flow_per_request_forward_from_ps_kv_to_ds_load(run):
    events = to_trace_events(run)["traceEvents"]
    by_id = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            by_id.setdefault(e["id"], {})[e["ph"]] = e
    # r4 reached D (d_queued), r5 never reached P's scheduler: no flow
    assert sorted(f["s"]["args"]["request_id"] for f in by_id.values()) == ["r1", "r2", "r3", "r4"]
    assert all(f["f"]["ts"] >= f["s"]["ts"] for f in by_id.values())  # forward in time, every one
    r1 = next(f for f in by_id.values() if f["s"]["args"]["request_id"] == "r1")
    assert r1["f"]["bp"] == "e" and r1["s"]["cat"] == r1["f"]["cat"]
    assert r1["s"]["ts"] == 23_999.0  # P's KV ready: the end of its prefill (4-24 ms), inside the slice
    assert r1["f"]["ts"] == 27_000.0  # D's load: the start of its transfer (27-31 ms)
    # r4 pulled nothing that was timed (it failed in its transfer): its arrow ends on D's queue.
    r4 = next(f for f in by_id.values() if f["s"]["args"]["request_id"] == "r4")
    assert r4["f"]["ts"] >= r4["s"]["ts"]


def test_out_of_order_events_still_give_a_valid_trace(tmp_path):
    # d_scheduled before transfer_end: the d_kv_wait interval is negative
    bad = make_record("x", {"arrival": 0, "dispatch": 1, "p_queued": 1, "p_scheduled": 2, "p_done": 5, "d_queued": 6,
                            "transfer_start": 7, "transfer_end": 12, "d_scheduled": 9, "d_first_token": 10,
                            "first_token": 11},
                      prefill_instance="P0", decode_instance="D0")
    trace = to_trace_events(load_run(write_run(tmp_path / "r", [bad])))
    assert validate_trace(trace) == []
    wait = next(e for e in trace["traceEvents"] if e.get("name") == "d_kv_wait" and e["ph"] == "B")
    assert wait["args"]["out_of_order_ns"] == 3_000_000


def _trace(*events: dict) -> dict:
    meta = {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "p"}}
    return {"traceEvents": [meta, *events], "displayTimeUnit": "ms"}


def _b(ts, name="a", tid=1):
    return {"name": name, "ph": "B", "ts": ts, "pid": 1, "tid": tid}


def _e(ts, name="a", tid=1):
    return {"name": name, "ph": "E", "ts": ts, "pid": 1, "tid": tid}


def test_validate_accepts_a_minimal_trace():
    assert validate_trace(_trace(_b(0), _b(1, "b"), _e(2, "b"), _e(3))) == []


def test_validate_unmatched_b():
    assert validate_trace(_trace(_b(0), _b(1, "b"), _e(2, "b"))) == ["B 'a' on pid 1 tid 1 at 0 is never closed"]


def test_validate_e_before_b():
    problems = validate_trace(_trace(_b(5), _e(3)))
    assert "event 2: E at 3 before its B 'a' at 5" in problems


def test_validate_improper_nesting():
    problems = validate_trace(_trace(_b(0, "a"), _b(1, "b"), _e(2, "a"), _e(3, "b")))
    assert "event 3: E 'a' closes B 'b' (not nested)" in problems


def test_validate_flow_without_f():
    s = {"name": "flow", "ph": "s", "cat": "c", "id": 7, "ts": 1, "pid": 1, "tid": 1}
    assert validate_trace(_trace(_b(0), s, _e(2))) == ["flow c/7: has ['s'], needs exactly one 's' and one 'f'"]


def test_validate_flow_outside_any_slice():
    s = {"name": "flow", "ph": "s", "cat": "c", "id": 7, "ts": 1, "pid": 1, "tid": 1}
    f = {"name": "flow", "ph": "f", "bp": "e", "cat": "c", "id": 7, "ts": 9, "pid": 1, "tid": 1}
    assert validate_trace(_trace(_b(0), s, _e(2), f)) == ["flow c/7: 'f' at 9 is inside no slice"]


def test_validate_missing_field():
    assert validate_trace(_trace({"name": "a", "ph": "B", "ts": 0, "pid": 1})) == ["event 1 (B): missing tid"]


def test_validate_metadata_and_top_level():
    assert validate_trace([]) == ["not a JSON object with a traceEvents list"]
    bad_meta = {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {}}
    assert validate_trace(_trace(bad_meta)) == ["event 1: metadata 'thread_name' needs args.name"]
    unnamed = {"traceEvents": [_b(0), _e(1)]}
    assert validate_trace(unnamed) == ["pid 1 has slices but no process_name"]


def test_cli_export_default_path(tmp_path, capsys):
    path = write_run(tmp_path / "run")
    ap = argparse.ArgumentParser(prog="pdc")
    add_timeline_commands(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["timeline", "export", str(path), "--format", "perfetto"])
    a.fn(a)
    out = capsys.readouterr().out.strip()
    assert out == str(path / "trace.json") and validate_trace(json.loads((path / "trace.json").read_text())) == []
