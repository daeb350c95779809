"""bench.outputs: the run directory's files, the join with router timelines, the terminal text."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict

import pytest

from pdcluster.cluster.replay.metrics import summarize_phases
from pdcluster.cluster.replay.outputs import CSV_HEADER, format_phase_breakdown, format_summary, write_run
from pdcluster.cluster.replay.records import RequestResult
from pdcluster.router.timeline import RequestRecord

T = 5_000_000_000  # router-clock origin (ns)
MS = 1_000_000


def res(index, start, end, chunks=(), tokens=(), prompt=128, phase="formal", error=None, cached=None,
        expected=None) -> RequestResult:
    return RequestResult(index=index, phase=phase, prompt_tokens=prompt, start_s=start, end_s=end,
                         request_id=f"r-{index}", output_tokens=sum(tokens), chunk_s=list(chunks),
                         chunk_tokens=list(tokens), cached_tokens=cached, expected_cached_tokens=expected,
                         error=error)


RESULTS = [
    res(0, 0.0, 1.0, chunks=(0.5, 0.75, 1.0), tokens=(1, 1, 1), cached=64, expected=64),
    res(1, 0.5, 2.5, chunks=(0.75, 2.0, 2.5), tokens=(1, 2, 2)),
    res(2, 0.25, 3.0, error="HTTP 503: no decode instance"),
    res(7, -5.0, -4.0, chunks=(-4.5,), tokens=(1,), phase="warmup"),
]

# The router's record of r-0: queue 1 ms, prefill 10, transfer 3 (exposed), d_wait 2, first_decode 4 ms.
EVENTS_MS = {"arrival": 0, "dispatch": 0.5, "p_scheduled": 1, "p_done": 11, "transfer_start": 12, "transfer_end": 15,
             "d_scheduled": 16, "d_first_token": 19, "first_token": 20, "last_token": 500, "finish": 501}
REC = RequestRecord("r-0", prompt_tokens=128, output_tokens=3, prefill_instance="p0", decode_instance="d0",
                    p_cached_tokens=64, d_cached_tokens=32, transferred_tokens=64,
                    events={e: T + int(ms * MS) for e, ms in EVENTS_MS.items()})
BREAKDOWN_MS = {"queue": 1.0, "prefill": 10.0, "transfer": 3.0, "d_wait": 2.0, "first_decode": 4.0}


@pytest.fixture
def run_dir(tmp_path):
    summaries = summarize_phases(RESULTS, max_concurrency=2)
    write_run(tmp_path / "run", RESULTS, summaries.values(), {"max_concurrency": 2, "workload": "hand"},
              {"r-0": REC, "r-unrelated": REC})
    return tmp_path / "run", summaries


def test_files_exist_and_summary_json_equals_summarize(run_dir):
    path, summaries = run_dir
    for name in ("summary.json", "summary.csv", "requests.jsonl"):
        assert (path / name).is_file()
    doc = json.loads((path / "summary.json").read_text())
    assert doc["config"] == {"max_concurrency": 2, "workload": "hand"}
    assert list(doc["phases"]) == ["formal"]  # warmup is not summarized
    got, want = doc["phases"]["formal"], summaries["formal"]
    for key, value in asdict(want).items():
        if key not in ("stats", "failures"):
            assert got[key] == value, key
    assert got["benchmark_duration_s"] == 3.0 and got["concurrency"] == 1.0  # (1 + 2) / 3
    for metric, st in want.stats.items():
        assert {k: v for k, v in got["stats"][metric].items() if k != "unit"} == asdict(st)
    assert got["stats"]["TTFT"]["unit"] == "s" and got["stats"]["TTFT"]["p50"] == 0.375
    assert got["failures"] == [{"index": 2, "request_id": "r-2", "error": "HTTP 503: no decode instance"}]


def test_csv_header_and_ttft_row_in_ms(run_dir):
    path, _ = run_dir
    rows = list(csv.reader((path / "summary.csv").open()))
    assert rows[0] == CSV_HEADER
    ttft = next(r for r in rows if r[0] == "TTFT")
    # TTFTs 0.5 s and 0.25 s: avg 375, min 250, max 500, median 375, P75 437.5, P90 475, P99 497.5 ms
    assert ttft[1] == "formal" and ttft[-2:] == ["2", "ms"]
    assert [float(v) for v in ttft[2:9]] == [375.0, 250.0, 500.0, 375.0, 437.5, 475.0, 497.5]
    tokens = next(r for r in rows if r[0] == "InputTokens")
    assert tokens[-1] == "tokens" and float(tokens[2]) == 128.0  # not scaled to ms
    assert len(rows) == 1 + 8 + 13  # one row per metric for the one phase, then the 13 common metrics
    common = {r[0]: r for r in rows[9:]}
    assert common["Request Throughput"][1:3] == ["formal", str(round(summarize_one(path).request_throughput_per_s, 4))]
    assert common["Request Throughput"][-1] == "req/s" and common["Total Requests"][3:10] == [""] * 7


def test_requests_jsonl_joins_timeline_by_request_id(run_dir):
    path, _ = run_dir
    lines = [json.loads(line) for line in (path / "requests.jsonl").read_text().splitlines()]
    assert [line["request_id"] for line in lines] == ["r-0", "r-1", "r-2", "r-7"]  # warmup kept, marked
    r0 = lines[0]
    assert (r0["index"], r0["phase"], r0["chunk_s"], r0["cached_tokens"]) == (0, "formal", [0.5, 0.75, 1.0], 64)
    assert r0["metrics"]["ttft_s"] == 0.5 and r0["metrics"]["tpot_s"] == 0.25 and r0["metrics"]["itl_s"] == [0.25, 0.25]
    tl = r0["timeline"]
    assert tl["breakdown_ms"] == BREAKDOWN_MS
    assert tl["server_ttft_ms"] == 20.0 and tl["complete"] is True
    assert (tl["p_cached_tokens"], tl["d_cached_tokens"], tl["transferred_tokens"]) == (64, 32, 64)
    assert all(line["timeline"] is None for line in lines[1:])
    assert lines[2]["error"] == "HTTP 503: no decode instance"


def test_write_run_without_timelines(tmp_path):
    write_run(tmp_path, RESULTS[:1], [], {}, None)
    line = json.loads((tmp_path / "requests.jsonl").read_text())
    assert line["timeline"] is None and line["metrics"]["e2el_s"] == 1.0


def test_format_summary_shows_table_common_metrics_hits_and_failures():
    s = summarize_phases(RESULTS, max_concurrency=2)["formal"]
    text = format_summary(s)
    assert "HTTP 503: no decode instance" in text and "Failures: 1" in text
    ttft_line = next(line for line in text.splitlines() if line.startswith("TTFT"))
    assert "375 ms" in ttft_line and "250 ms" in ttft_line and ttft_line.rstrip().endswith("2")
    for label in ("Benchmark Duration", "Request Throughput", "Max Concurrency", "Total Token Throughput"):
        assert label in text
    assert "measured 50.00%" in text and "expected 50.00%" in text  # r-0: 64 / 128 both


def test_format_summary_caps_the_failure_list():
    many = [res(i, 0.0, 1.0, error=f"timeout #{i}") for i in range(13)]
    text = format_summary(summarize_phases(many)["formal"])
    assert "timeout #9" in text and "timeout #10" not in text and "and 3 more" in text
    assert "Failures: 13" in text


def test_format_phase_breakdown_means_and_shares():
    other = RequestRecord("r-x", events={e: T + 2 * int(ms * MS) for e, ms in EVENTS_MS.items()})  # twice as slow
    failed = RequestRecord("r-f", events={"arrival": T, "dispatch": T + MS}, error="boom")
    text = format_phase_breakdown([REC, other, failed])
    assert "over 2 requests" in text and "1 incomplete skipped" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[3:]}
    assert rows["prefill"] == ["15", "50.00%"]  # mean of 10 and 20 ms; 15 of 30 ms
    assert rows["queue"] == ["1.5", "5.00%"]
    assert rows["TTFT"][-2:] == ["30", "100.00%"]
    assert "no complete timelines" in format_phase_breakdown([failed])


def summarize_one(path):
    from pdcluster.cluster.replay.saved import load_saved

    return load_saved(path).phases["formal"]
