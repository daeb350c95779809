"""`--phase` and `--between` (router/timeline_window.py): on a replayed run the timeline tools look
at the formal window by default, as the replay's own figures do, and say which window they show."""

from __future__ import annotations

import argparse

import pytest
from test_timeline_views import make_record, write_run

from pdcluster.proto.load_phases import phase_of, replay_of, replay_request_id
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline_cli import add_timeline_commands
from pdcluster.router.timeline_window import parse_between, select


def replayed(phase: str, index: int, arrival_ms: int, ttft_ms: int, source: str = "bench-0a1b2c3d"):
    return make_record(f"cmpl-{replay_request_id(source, phase, index)}",
                       {"arrival": arrival_ms, "first_token": arrival_ms + ttft_ms, "finish": arrival_ms + ttft_ms + 1},
                       [arrival_ms + ttft_ms])


def replay_run(tmp_path):
    # Seeds are cold (slow), the formal window warm: a summary over all of them is not the replay's.
    records = [replayed("seed", 0, 0, 900), replayed("check", 1, 1000, 50),
               *(replayed("formal", 2 + k, 2000 + 100 * k, 40 + k) for k in range(4)),
               make_record("cmpl-a-user-request", {"arrival": 2500, "first_token": 2600, "finish": 2601}, [2600])]
    return load_run(write_run(tmp_path / "run", records))


def test_request_ids_name_their_replay_and_phase():
    assert replay_request_id("bench-0a1b2c3d", "formal", 7) == "bench-0a1b2c3d-formal-7"
    assert phase_of("cmpl-bench-0a1b2c3d-formal-7") == "formal" and replay_of("cmpl-sim-seed-0") == "sim"
    assert phase_of("cmpl-bench-0a1b2c3d-formal") is None and phase_of("chatcmpl-9f2e") is None


def test_a_replayed_run_is_read_in_its_formal_window_unless_asked_otherwise(tmp_path):
    run = replay_run(tmp_path)
    picked, line = select(run)
    assert [r.request_id.rsplit("-", 1)[1] for r in picked.records] == ["2", "3", "4", "5"]
    assert line == "window: the formal phase (4 of 7 requests; also seed 1, check 1; --phase all for every request)"
    everything, line = select(run, "all")
    assert len(everything.records) == 7 and line == "window: every request (7 of 7 requests)"
    seeds, _ = select(run, "seed")
    assert [r.request_id for r in seeds.records] == ["cmpl-bench-0a1b2c3d-seed-0"]
    late, line = select(run, "formal", between=(2.15, 10))  # arrivals 2.2 and 2.3 s after the first
    assert len(late.records) == 2 and "arrived 2.15-10 s after the first" in line
    # A run with no replay in it: every request, and nothing said of phases.
    plain, line = select(load_run(write_run(tmp_path / "plain", [make_record("r1", {"arrival": 0})])))
    assert len(plain.records) == 1 and line == "window: every request (1 of 1 requests)"


def test_of_two_replays_in_one_run_the_last_is_read_unless_another_is_named(tmp_path):
    records = [replayed("formal", 0, 0, 40), replayed("formal", 1, 10, 40),
               replayed("formal", 0, 100, 40, source="bench-99999999")]
    run = load_run(write_run(tmp_path / "run", records))
    last, line = select(run)
    assert [r.request_id for r in last.records] == ["cmpl-bench-99999999-formal-0"]
    assert line.startswith("window: the formal phase of replay bench-99999999 (2 in this run: --replay all for all)")
    first, _ = select(run, replay="bench-0a1b2c3d")
    assert len(first.records) == 2
    both, line = select(run, replay="all")
    assert len(both.records) == 3 and line.startswith("window: the formal phase of all 2 replays (3 of 3")
    with pytest.raises(ValueError, match="--replay bench-1: no such replay's formal phase"):
        select(run, replay="bench-1")


@pytest.mark.parametrize("text", ["5", "a,b", "3,1", "-1,2", "1,2,3"])
def test_a_bad_between_is_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match="--between"):
        parse_between(text)


def cli(*argv: str) -> None:
    parser = argparse.ArgumentParser(prog="pdc")
    add_timeline_commands(parser.add_subparsers(dest="cmd", required=True))
    a = parser.parse_args(["timeline", *argv])
    a.fn(a)


def test_the_summary_says_its_window_and_lists_the_slowest_requests(tmp_path, capsys):
    replay_run(tmp_path)
    cli("summary", str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert out.startswith("window: the formal phase (4 of 7 requests")
    assert "run-test: 4 requests, 4 completed" in out
    slowest = out.split("slowest TTFT")[1].splitlines()[1:5]
    assert [ln.split()[0] for ln in slowest] == [f"cmpl-bench-0a1b2c3d-formal-{k}" for k in (5, 4, 3, 2)]
    assert slowest[0].split()[1] == "43.00"
    cli("summary", str(tmp_path / "run"), "--phase", "all")
    assert "run-test: 7 requests" in capsys.readouterr().out
    for argv, message in ((["--phase", "warmup"], "no request of run run-test in that window"),
                          (["--between", "2,1"], "--between '2,1': needs 0 <= A < B")):
        with pytest.raises(SystemExit) as err:
            cli("summary", str(tmp_path / "run"), *argv)
        assert err.value.code == 2 and message in capsys.readouterr().err


def test_show_without_a_request_draws_the_windows_slowest(tmp_path, capsys):
    replay_run(tmp_path)
    cli("show", str(tmp_path / "run"), "--width", "80")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("window: the formal phase")
    assert out[1] == "the slowest first token in the window: cmpl-bench-0a1b2c3d-formal-5"  # 43 ms
    assert out[2].startswith("request cmpl-bench-0a1b2c3d-formal-5:")
    cli("show", str(tmp_path / "run"), "--phase", "seed", "--width", "80")
    assert "slowest first token in the window: cmpl-bench-0a1b2c3d-seed-0" in capsys.readouterr().out
