"""`pdc bench show` and `pdc bench compare` read saved results back (cluster/replay/saved.py);
`pdc bench run` takes `vllm bench serve`'s names and shows every default in --help."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdcluster.cluster.cli import main
from pdcluster.cluster.replay.bench_cli import add_bench_commands
from pdcluster.cluster.replay.outputs import format_summary

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
LOAD = ["--input-len", "4100", "--shared-prefix-ratio", str(3712 / 4100), "--output-len", "16", "--num-prefixes", "2",
        "--num-requests", "12", "--max-concurrency", "4", "--request-rate", "4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """Two virtual-clock runs of one load on P1D1, the second with twice the output."""
    tmp = tmp_path_factory.mktemp("saved")
    spec = str(DEPLOY / "p1d1-tiny-cpu.yaml")
    main(["sim", "run", spec, "--params", "tiny-qwen3-cpu", *LOAD, "--vocab-size", "1000", "--out", str(tmp / "a")])
    main(["sim", "run", spec, "--params", "tiny-qwen3-cpu", *LOAD, "--vocab-size", "1000", "--output-len", "32",
          "--out", str(tmp / "b")])
    return tmp / "a", tmp / "b"


def test_show_prints_the_formal_table_as_the_run_did(saved, capsys):
    from pdcluster.cluster.replay.saved import load_saved

    a, _ = saved
    capsys.readouterr()
    main(["bench", "show", str(a)])
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"{a}: synthetic, 12 requests, at most 4 in flight, 4.0 req/s cap")
    assert "seed phase: 2/2 ok" in out and "check phase: 2/2 ok" in out
    assert format_summary(load_saved(a).phases["formal"]) in out
    main(["bench", "show", str(a), "--phase", "seed"])
    assert capsys.readouterr().out.startswith("== phase: seed ==")


def test_compare_sets_the_formal_windows_side_by_side_with_ratios(saved, capsys):
    a, b = saved
    capsys.readouterr()
    main(["bench", "compare", str(a), str(b)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["metric", "[1]", "a", "[2]", "b"]
    e2e = next(ln for ln in lines if ln.startswith("E2EL mean"))
    first, second = e2e.split("(ms)")[1].split()[:2]
    ratio = e2e.rsplit("(x", 1)[1].rstrip(")")
    assert float(second.replace(",", "")) / float(first.replace(",", "")) == pytest.approx(float(ratio), abs=0.006)
    assert float(ratio) > 1.3  # twice the output tokens
    assert any(ln.startswith("Prefix cache hit") and ln.count("90.54%") == 2 for ln in lines)


@pytest.mark.parametrize("argv, message", [
    (["show", "/nonexistent/run"], "not a bench result directory"),
    (["compare", "/nonexistent/run"], "two result directories or more"),
])
def test_bad_input_is_refused_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench", *argv])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_a_phase_the_run_lacks_is_named(saved, capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench", "show", str(saved[0]), "--phase", "warmup"])
    assert err.value.code == 2 and "--phase warmup: " in capsys.readouterr().err


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdc")
    add_bench_commands(parser.add_subparsers(dest="cmd", required=True))
    return parser


def test_vllm_bench_serves_names_are_aliases():
    a = bench_parser().parse_args(["bench", "run", "--num-prompts", "5", "--random-input-len", "100",
                                   "--random-output-len", "8", "--dataset-path", "t.jsonl", "--result-dir", "out"])
    assert (a.num_requests, a.input_len, a.output_len, a.trace, a.out) == (5, 100, 8, "t.jsonl", "out")


def test_every_load_flag_shows_its_default_in_help():
    run = next(act for act in bench_parser()._subparsers._group_actions[0].choices["bench"]._subparsers
               ._group_actions[0].choices.items() if act[0] == "run")[1]
    quiet = {"help", "preset", "trace", "closed_loop", "progress", "out", "api_key"}  # flags, not values
    missing = [act.dest for act in run._actions if act.dest not in quiet and "default" not in (act.help or "")]
    assert not missing, missing
