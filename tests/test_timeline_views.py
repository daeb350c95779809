"""Summary and waterfall of a small hand-made run; the run factory here is shared by the
Perfetto and report tests (imported as `from test_timeline_views import ...`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdcluster.router.run_store import InstanceMeta, RunMeta, RunStore, load_run
from pdcluster.router.timeline import ClockOffset, GroupTransfer, RequestRecord
from pdcluster.router.timeline_cli import add_timeline_commands
from pdcluster.router.timeline_views import FailureKind, Ratios, format_summary, format_waterfall, summarize

MS = 1_000_000
T = 5_000_000_000_000  # an arbitrary router-clock origin: everything below is T + whole ms


def make_record(request_id: str, events_ms: dict[str, int], token_ms: list[int] = (), **fields) -> RequestRecord:
    return RequestRecord(request_id, events={e: T + ms * MS for e, ms in events_ms.items()},
                         token_ns=[T + ms * MS for ms in token_ms], output_tokens=len(token_ms), **fields)


def sample_records() -> list[RequestRecord]:
    """Three complete requests, one failed during the KV pull, one failed before prefill started."""
    return [
        make_record("r1", {"arrival": 0, "dispatch": 1, "p_queued": 2, "p_scheduled": 4, "p_done": 24,
                           "d_queued": 26, "transfer_start": 27, "transfer_end": 31, "d_kv_ready": 32,
                           "d_scheduled": 33, "d_first_token": 38, "first_token": 40, "last_token": 100, "finish": 101},
                    [40, 45, 55, 60, 70, 90, 100], prefill_instance="P0", decode_instance="D0", prompt_tokens=100,
                    p_cached_tokens=20, transferred_tokens=80, finish_reason="length",
                    transfer_groups=[GroupTransfer(0, 5, 1000, "swa_kv"), GroupTransfer(1, 5, 500)]),
        make_record("r2", {"arrival": 10, "dispatch": 12, "p_queued": 13, "p_scheduled": 20, "p_done": 50,
                           "d_queued": 51, "transfer_start": 52, "transfer_end": 60, "d_kv_ready": 61,
                           "d_scheduled": 64, "d_first_token": 66, "first_token": 70, "last_token": 106, "finish": 106},
                    [70, 75, 85, 106], prefill_instance="P1", decode_instance="D0", prompt_tokens=300,
                    p_cached_tokens=100, p_tier_tokens=64, d_cached_tokens=30, d_tier_tokens=16, transferred_tokens=170,
                    finish_reason="stop",
                    transfer_groups=[GroupTransfer(0, 10, 3000, "swa_kv"), GroupTransfer(1, 10, 1500)]),
        make_record("r3", {"arrival": 20, "dispatch": 21, "p_queued": 21, "p_scheduled": 22, "p_done": 32,
                           "d_queued": 33, "transfer_start": 34, "transfer_end": 35, "d_kv_ready": 35,
                           "d_scheduled": 36, "d_first_token": 38, "first_token": 40, "last_token": 40, "finish": 41},
                    [40], prefill_instance="P0", decode_instance="D0", prompt_tokens=100, transferred_tokens=100,
                    finish_reason="length", transfer_groups=[GroupTransfer(0, 4, 2000, "swa_kv"), GroupTransfer(1, 4, 1000)]),
        make_record("r4", {"arrival": 30, "dispatch": 31, "p_queued": 32, "p_scheduled": 35, "p_done": 45,
                           "d_queued": 47, "transfer_start": 48, "finish": 90},
                    prefill_instance="P1", decode_instance="D0", prompt_tokens=50,
                    error="decode instance D0 ended r4 without a finish"),
        make_record("r5", {"arrival": 40, "dispatch": 41, "finish": 140}, prefill_instance="P0", decode_instance="D0",
                    prompt_tokens=20, error="prefill of r5 on P0 timed out after 0 s"),
    ]


def write_run(path: Path, records: list[RequestRecord] | None = None) -> Path:
    clock = ClockOffset(0, 1000)
    meta = RunMeta("run-test", started_wall_ns=1_700_000_000 * 10**9, started_mono_ns=T, spec={"model": "tiny"},
                   versions={"python": "3.11"},
                   instances=[InstanceMeta("P0", "prefill", "10.0.0.1", 11, clock),
                              InstanceMeta("P1", "prefill", "10.0.0.2", 12, clock),
                              InstanceMeta("D0", "decode", "10.0.0.3", 13, clock)])
    store = RunStore(path, meta)
    for rec in sample_records() if records is None else records:
        store.append(rec)
    store.close()
    return path


@pytest.fixture
def run(tmp_path):
    return load_run(write_run(tmp_path / "run"))


def test_summary_numbers(run):
    s = summarize(run)
    assert (s.run_id, s.total, s.completed, s.failed, s.attributed) == ("run-test", 5, 3, 2, 3)
    q, p, t, w, f, ttft = (s.phases[k] for k in ("queue", "prefill", "transfer", "d_wait", "first_decode", "ttft"))
    assert (q.n, q.mean_ms, q.p50_ms, q.p90_ms, q.p99_ms) == (4, 5.25, 4, 10, 10)  # [2, 4, 5, 10]
    assert (p.n, p.mean_ms, p.p50_ms, p.p90_ms) == (4, 17.5, 10, 30)  # [10, 10, 20, 30]: r4 got through prefill
    assert (t.n, t.p50_ms, t.p90_ms) == (3, 4, 8) and t.mean_ms == pytest.approx(13 / 3)
    assert (w.p50_ms, w.p99_ms, f.p50_ms, f.p90_ms) == (5, 6, 6, 7)
    assert (ttft.n, ttft.mean_ms, ttft.p50_ms, ttft.p90_ms, ttft.p99_ms) == (3, 40, 40, 60, 60)
    assert s.shares == pytest.approx({"queue": 16 / 120, "prefill": 60 / 120, "transfer": 13 / 120,
                                      "d_wait": 14 / 120, "first_decode": 17 / 120})
    assert sum(s.shares.values()) == pytest.approx(1)
    assert s.intervals["router"].mean_ms == pytest.approx(1.2) and s.intervals["router"].n == 5
    assert (s.intervals["p_queue"].mean_ms, s.intervals["handoff"].mean_ms, s.intervals["decode"].mean_ms) == (
        3.25, 1.5, 32)
    assert s.intervals["d_kv_wait"].mean_ms == pytest.approx(7 / 3)
    # ITL pooled: r1 [5,10,5,10,20,10] + r2 [5,10,21]; TPOT r1 60/6, r2 36/3; r3 has one token
    assert (s.itl.n, s.itl.p50_ms, s.itl.p90_ms, s.itl.p99_ms) == (9, 10, 21, 21)
    assert s.itl.mean_ms == pytest.approx(96 / 9)
    assert (s.tpot.n, s.tpot.mean_ms, s.tpot.p50_ms, s.tpot.p90_ms) == (2, 11, 10, 12)
    assert (s.prompt_tokens, s.p_cached_tokens, s.d_cached_tokens, s.transferred_tokens) == (570, 120, 30, 350)
    assert s.p_hit_ratio == pytest.approx(120 / 570) and s.d_hit_ratio == pytest.approx(30 / 570)
    assert (s.p_tier_tokens, s.d_tier_tokens) == (64, 16)  # of P's and D's hits, what their host tiers gave
    assert s.bytes_per_group == {"group 0 (swa_kv)": 6000, "group 1": 3000}  # a group's name where D gave one
    assert [(f.request_id, f.stopped_after) for f in s.failures] == [("r4", "transfer_start"), ("r5", "dispatch")]
    assert sorted(s.failure_kinds, key=lambda k: k.stopped_after) == [
        FailureKind("dispatch", "prefill of <request> on P0 timed out after 0 s", 1),
        FailureKind("transfer_start", "decode instance D0 ended <request> without a finish", 1)]


def test_summary_text(run):
    text = format_summary(summarize(run))
    assert text.startswith("run run-test: 5 requests, 3 completed, 2 failed")
    assert "  queue              4      5.25      4.00     10.00     10.00   13.3%" in text
    assert "  TTFT               3     40.00     40.00     60.00     60.00  100.0%" in text
    assert "P cached 120 (hit 21.1%, 64 from its host tier)" in text and "group 0 (swa_kv): 6.0 kB, group 1: 3.0 kB" in text
    assert "r4: after transfer_start: decode instance D0 ended r4 without a finish" in text


def test_empty_run_summary(tmp_path):
    s = summarize(load_run(write_run(tmp_path / "empty", [])))
    assert (s.total, s.phases, s.shares, s.itl, s.p_hit_ratio) == (0, {}, {}, None, None)
    assert "0 requests" in format_summary(s)


def test_waterfall_rows_and_split(run):
    text = format_waterfall(run, "r1", width=72)
    lines = text.splitlines()
    assert lines[0] == "request r1: P P0 -> D D0, finish length"
    prefill = next(ln for ln in lines if ln.startswith("  prefill "))
    assert prefill.split()[:4] == ["prefill", "prefill", "4.000", "20.000"]
    assert all(len(ln) <= 72 for ln in lines if "█" in ln)
    # bar: 72 - 46 label columns = 26 over the 101 ms span; 4..24 ms -> columns 4*26//101 = 1 to ceil(24*26/101) = 7
    assert prefill[46:] == " " + "█" * 6
    for name in ("router", "p_queue", "handoff", "d_queue", "transfer", "d_kv_wait", "first_decode", "return",
                 "decode"):
        assert any(ln.startswith(f"  {name} ") for ln in lines), name
    assert "TTFT 40.000 ms; critical path:" in text
    assert "tokens: prompt 100, P cached 20, D cached 0," in text  # no tier hit: nothing said of one
    assert ("tokens: prompt 300, P cached 100 (64 from its host tier), D cached 30 (16 from its host tier),"
            in format_waterfall(run, "r2"))
    assert "  transfer          4.000 ms   10.0%" in text
    assert "KV bytes: group 0 (swa_kv): 5 blocks 1.0 kB, group 1: 5 blocks 500 B" in text
    assert "FAILED" not in text


def test_waterfall_of_failed_request(run):
    text = format_waterfall(run, "r4")
    assert "TTFT not reached" in text
    assert "FAILED: stopped after transfer_start: decode instance D0 ended r4 without a finish" in text
    assert "\n  first_decode          -\n" in text  # a part without both bounds


def test_waterfall_unknown_request(run):
    with pytest.raises(KeyError, match="nope"):
        format_waterfall(run, "nope")


def _cli(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdc")
    add_timeline_commands(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(list(argv))
    a.fn(a)
    return a


def test_cli_summary_and_show(tmp_path, capsys):
    path = write_run(tmp_path / "run")
    _cli("timeline", "summary", str(path))
    assert "5 requests, 3 completed, 2 failed" in capsys.readouterr().out
    _cli("timeline", "show", str(path), "r2")
    assert "request r2: P P1 -> D D0" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [(("summary", "{missing}"), "not a run directory"),
                                          (("show", "{run}", "nope"), "no request 'nope'")])
def test_cli_errors_exit_2_without_traceback(tmp_path, capsys, argv, message):
    path = write_run(tmp_path / "run")
    argv = [a.format(run=path, missing=tmp_path / "missing") for a in argv]
    with pytest.raises(SystemExit) as exc:
        _cli("timeline", *argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_summary_splits_transfer_hidden_under_prefills_from_exposed(tmp_path):
    pull = sample_records()[0]  # transfer [27, 31] after p_done 24: 4 ms exposed
    push = make_record("p1", {"arrival": 0, "dispatch": 1, "d_queued": 2, "transfer_start": 3, "p_queued": 2,
                              "p_scheduled": 4, "transfer_end": 25, "p_done": 24, "d_kv_ready": 26,
                              "d_scheduled": 27, "d_first_token": 30, "first_token": 31, "last_token": 31,
                              "finish": 32}, [31], prompt_tokens=100, transferred_tokens=100)
    s = summarize(load_run(write_run(tmp_path / "r", [pull, push])))
    # push: [3, 25] under the prefill [4, 24] for 20 ms, 1 ms after it; pull: 4 ms after it
    assert (s.transfer_hidden_ns, s.transfer_exposed_ns) == (20 * MS, 5 * MS)
    assert "KV transfer time: 20.0 ms hidden under prefills (80.0%), 5.0 ms on the critical path" in format_summary(s)


def test_summary_sets_predicted_hits_beside_delivered_ones(tmp_path):
    records = sample_records()
    for r in records:
        r.policy = "prefix_aware"
    records[0].predicted_p_hit_tokens, records[0].predicted_d_hit_tokens = 20, 0  # exact, exact
    records[1].predicted_p_hit_tokens, records[1].predicted_d_hit_tokens = 128, 0  # over, under
    records[3].predicted_p_hit_tokens = 50  # failed: not counted
    s = summarize(load_run(write_run(tmp_path / "run", records)))
    p, d = s.predictions["P"], s.predictions["D"]
    assert (p.requests, p.predicted_tokens, p.delivered_tokens, p.exact, p.over, p.under) == (2, 148, 120, 1, 1, 0)
    assert (d.requests, d.predicted_tokens, d.delivered_tokens, d.exact, d.over, d.under) == (2, 0, 30, 1, 0, 1)
    assert s.requests_per_instance == {"D0": 5, "P0": 3, "P1": 2}
    text = format_summary(s)
    assert "routing: prefix_aware" in text
    assert "P hit predicted 37.0%, delivered 30.0%; per request: 1 exact, 1 over, 0 under (of 2)" in text


def test_summary_sets_the_predicted_prefill_time_beside_the_engines(tmp_path):
    records = sample_records()
    for r in records:
        r.policy = "prefix_aware"
    # P's engine took 20, 30 and 10 ms (p_scheduled to p_done); r4 failed and is not counted.
    for r, predicted_s in zip(records, (0.02, 0.06, 0.005, 1.0)):
        r.predicted_p_prefill_s = predicted_s
    s = summarize(load_run(write_run(tmp_path / "run", records)))
    assert s.prefill_time_ratio == Ratios(3, 0.5, 1.0, 2.0)
    assert "P prefill time predicted / taken: median 1.00x (p10 0.50x, p90 2.00x; 3 requests)" in format_summary(s)


def test_summary_without_routing_records_has_no_routing_lines(tmp_path):
    assert "routing:" not in format_summary(summarize(load_run(write_run(tmp_path / "run"))))


def test_a_run_written_by_several_routers_loads_as_one_in_finish_order(tmp_path):
    recs = sample_records()
    first = write_run(tmp_path / "run", [r for r in recs if r.request_id in ("r1", "r4")])
    second = RunStore(first, None, writer=2)  # router 2 of the same run: no meta.json of its own
    for rec in recs:
        if rec.request_id not in ("r1", "r4"):
            second.append(rec)
    second.close()
    assert sorted(p.name for p in first.iterdir()) == ["meta.json", "requests-2.jsonl", "requests.jsonl"]
    run = load_run(first)
    assert sorted(r.request_id for r in run.records) == sorted(r.request_id for r in recs)
    finishes = [r.events["finish"] for r in run.records]
    assert finishes == sorted(finishes)


def test_only_the_first_router_of_a_run_writes_its_meta(tmp_path):
    with pytest.raises(AssertionError, match="writer 0"):
        RunStore(tmp_path / "run", None, writer=0)


def test_a_torn_last_line_is_skipped_with_a_warning_and_a_torn_middle_is_an_error(tmp_path):
    path = write_run(tmp_path / "run")
    requests = path / "requests.jsonl"
    whole = requests.read_text()
    requests.write_text(whole + whole.splitlines()[0][:40])  # a router killed while writing a record
    with pytest.warns(RuntimeWarning, match="torn last line"):
        run = load_run(path)
    assert [r.request_id for r in run.records] == [r.request_id for r in sample_records()]
    lines = whole.splitlines()
    requests.write_text("\n".join([lines[0][:40], *lines[1:]]) + "\n")  # not a crash: corruption
    with pytest.raises(ValueError, match="requests.jsonl:1: not a request record"):
        load_run(path)
