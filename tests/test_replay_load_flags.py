"""The load flags of `pdc bench run`, `pdc sim run` and `pdc plan` (cluster/replay/run.py
add_load_arguments, config_from_args, check_load): a trace on its timestamps is replayed with
no cap on requests in flight unless one is given (issue 28 item 1), and a value that makes no
load is refused naming its flag, with exit code 2 at the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from fake_openai import FakeServerState, serve_fake

from pdcluster.cluster.cli import main
from pdcluster.cluster.replay.bench_cli import add_load_arguments, config_from_args
from pdcluster.cluster.replay.run import run_bench

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_load_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), progress=False)


def trace_file(tmp_path: Path, n: int, at_ms: int = 0, input_length: int = 600) -> str:
    """A Mooncake-format trace of n requests arriving at once, each its own prefix."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": at_ms, "input_length": input_length, "output_length": 4,
                                        "hash_ids": [2 * i, 2 * i + 1]}) + "\n" for i in range(n)))
    return str(path)


def test_a_trace_on_its_timestamps_has_no_cap_unless_one_is_given(tmp_path):
    t = trace_file(tmp_path, 4)
    assert parse("--trace", t).max_concurrency is None
    assert parse("--trace", t, "--max-concurrency", "16").max_concurrency == 16
    assert parse("--trace", t, "--closed-loop").max_concurrency == 8  # a closed loop needs one
    assert parse("--input-len", "100").max_concurrency == 8 and parse("--preset", "c90").max_concurrency == 90


@pytest.mark.parametrize("argv, message", [
    (["--num-requests", "0"], "--num-requests 0: must be above 0"),
    (["--num-requests", "-5"], "--num-requests -5: must be above 0"),
    (["--max-concurrency", "0"], "--max-concurrency 0: must be above 0"),
    (["--request-rate", "-1"], "--request-rate -1.0: must be above 0"),
    (["--burstiness", "-0.5"], "--burstiness -0.5: must be 0 or more"),
    (["--output-len", "0"], "--output-len 0: must be above 0"),
    (["--input-len", "0"], "--input-len 0: must be above 0"),
    (["--shared-prefix-ratio", "1.0"], "--shared-prefix-ratio 1.0: must be between 0 and 1"),
    (["--time-scale", "0"], "--time-scale 0.0: must be above 0"),
    (["--duration", "0"], "--duration 0.0: must be above 0"),
    (["--warmup", "-1"], "--warmup -1: must be 0 or more"),
    (["--trace", "/nonexistent/t.jsonl"], "--trace /nonexistent/t.jsonl: no such file"),
    (["--preset", "c90-tiny", "--trace", "x.jsonl"], "--preset c90-tiny and --trace"),
])
def test_a_value_that_makes_no_load_is_refused_naming_its_flag(argv, message):
    with pytest.raises(ValueError) as err:
        parse(*argv)
    assert message in str(err.value)


@pytest.mark.parametrize("argv", [["--num-requests", "-5"], ["--max-concurrency", "0"], ["--request-rate", "-1"]])
def test_the_commands_exit_2_naming_the_flag(argv, capsys, tmp_path):
    """Issue 28: `pdc sim run ... --num-requests -5` and `--max-concurrency 0` ended in a traceback."""
    for command in (["sim", "run", str(DEPLOY / "p8d8-sim.yaml"), "--out", str(tmp_path / "s")],
                    ["bench", "run", "--base-url", "http://127.0.0.1:9"],
                    ["plan", "dsv4-flash-910c", "--devices", "4", "--slo-ttft-ms", "1000", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as err:
            main([*command, *argv])
        assert err.value.code == 2 and argv[0] in capsys.readouterr().err, command


def test_a_trace_arriving_at_once_is_sent_at_once(tmp_path):
    """64 requests with one timestamp: 64 in flight at the server, not the old silent 8. Each
    answers after 0.5 s, longer than sending all 64 takes even on a loaded machine (at 0.05 s
    one had answered before the last was sent, in a clean-clone run)."""
    state = FakeServerState(delay_s=0.5)
    cfg = dataclasses.replace(parse("--trace", trace_file(tmp_path, 64), "--engine-block-size", "128"),
                              out=None, seed_phase=False)
    with serve_fake(state) as url:
        run = run_bench(dataclasses.replace(cfg, base_url=url), log=lambda m: None)
    assert len(run.results) == 64 and all(r.ok for r in run.results)
    assert state.max_in_flight == 64


def test_the_virtual_clock_sends_it_at_once_too(tmp_path):
    from pdcluster.cluster.sim.plan_headroom import _peak_in_flight
    from pdcluster.cluster.sim.virtual.run import simulate
    from pdcluster.proto.spec import load_spec

    cfg = dataclasses.replace(parse("--trace", trace_file(tmp_path, 64)), seed_phase=False)
    run = simulate(load_spec(DEPLOY / "p8d8-sim.yaml"), cfg)
    formal = [r for r in run.results if r.phase == "formal"]
    assert len(formal) == 64 and _peak_in_flight(formal) == 64
