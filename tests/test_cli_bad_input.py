"""Issue 28 item 5: every `pdc` subcommand, given a bad value (negative, zero, a missing file or
directory, conflicting options), ends with exit code 2 and a message naming the input, never a
traceback. Each leaf command of the parser must have a case here: a new command adds its own."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdcluster.cluster import cli

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SIM = str(DEPLOY / "p8d8-sim.yaml")
NO = "/nonexistent/pdc-bad-input"

# (command, its bad argv after the command, what the message must name)
CASES = [
    ("model tiny", ["model", "tiny", f"{NO}/m", "--seed", "-1"], "--seed -1"),
    ("model tiny", ["model", "tiny", f"{NO}/m", "--arch", "bert"], "'bert'"),
    ("up", ["up", f"{NO}.yaml"], f"{NO}.yaml: no such file"),
    ("check", ["check", f"{NO}.yaml"], f"{NO}.yaml: no such file"),
    ("status", ["status", "--name"], "--name: expected one argument"),
    ("down", ["down", "--name", "a", "--all"], "--name and --all"),
    ("demo", ["demo", f"{NO}.yaml"], f"{NO}.yaml: no such file"),
    ("demo", ["demo", "--replay", "c91"], "'c91'"),
    ("timeline summary", ["timeline", "summary", NO], f"{NO} is not a run directory"),
    ("timeline summary", ["timeline", "summary", NO, "--phase", "nope"], "'nope'"),
    ("timeline show", ["timeline", "show", NO, "r1"], f"{NO} is not a run directory"),
    ("timeline export", ["timeline", "export", NO], f"{NO} is not a run directory"),
    ("timeline report", ["timeline", "report", NO, "--between", "5,1"], f"{NO} is not a run directory"),
    ("lab up", ["lab", "up", "--hosts", "0"], "hosts: 0"),
    ("lab up", ["lab", "up", "--hosts", "2", "--subnet", "10.0.0.0/33"], "subnet '10.0.0.0/33'"),
    ("lab status", ["lab", "status", "--name", "nosuchlab"], "no lab 'nosuchlab'"),
    ("lab down", ["lab", "down", "--name", "Bad-Name"], "lab name 'Bad-Name'"),
    ("lab exec", ["lab", "exec", "--name", "nosuchlab", "host1", "true"], "no lab 'nosuchlab'"),
    ("lab link", ["lab", "link", "--name", "nosuchlab", "host1", "down"], "no lab 'nosuchlab'"),
    ("lab kill", ["lab", "kill", "--name", "nosuchlab", "host1"], "no lab 'nosuchlab'"),
    ("lab revive", ["lab", "revive", "--name", "nosuchlab", "host1"], "no lab 'nosuchlab'"),
    ("lab partition", ["lab", "partition", "--name", "nosuchlab", "host1", "host2"], "no lab 'nosuchlab'"),
    ("lab heal", ["lab", "heal", "--name", "nosuchlab", "host1", "host2"], "no lab 'nosuchlab'"),
    ("bench run", ["bench", "run", "--num-requests", "-5"], "--num-requests -5"),
    ("bench run", ["bench", "run", "--max-concurrency", "0"], "--max-concurrency 0"),
    ("bench run", ["bench", "run", "--preset", "c90-tiny", "--trace", f"{NO}.jsonl"], "--preset c90-tiny and --trace"),
    ("bench run", ["bench", "run", "--trace", f"{NO}.jsonl"], f"--trace {NO}.jsonl: no such file"),
    ("bench run", ["bench", "run", "--request-rate", "0"], "--request-rate 0"),
    ("bench show", ["bench", "show", NO], f"{NO}: not a bench result directory"),
    ("bench compare", ["bench", "compare", NO], "two result directories or more"),
    ("sim run", ["sim", "run", SIM, "--num-requests", "-5"], "--num-requests -5"),
    ("sim run", ["sim", "run", SIM, "--params", "nosuch"], "no shipped parameter file 'nosuch'"),
    ("sim run", ["sim", "run", f"{NO}.yaml"], f"{NO}.yaml: no such file"),
    ("sim fit", ["sim", "fit", NO, "--params", "tiny-qwen3-cpu", "--out", f"{NO}/x.yaml"], f"{NO} is not a run"),
    ("plan", ["plan", "dsv4-flash-910c", "--devices", "1", "--slo-ttft-ms", "100"], "--devices 1"),
    ("plan", ["plan", "dsv4-flash-910c", "--devices", "4"], "no SLO"),
    ("plan", ["plan", "dsv4-flash-910c", "--devices", "4", "--slo-ttft-ms", "100", "--splits", "1,x"], "--splits '1,x'"),
]


def leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> set[str]:
    out = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = leaf_commands(sub, (*prefix, name))
                out |= nested or {" ".join((*prefix, name))}
    return out


def test_every_command_has_a_bad_input_case():
    missing = leaf_commands(cli.build_parser()) - {command for command, _, _ in CASES}
    assert not missing, f"commands without a bad-input case here: {sorted(missing)}"


@pytest.mark.parametrize("command, argv, names", CASES, ids=[" ".join(c[1][:4]) for c in CASES])
def test_a_bad_value_exits_2_naming_it(command, argv, names, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "STATE_DIR", tmp_path / "state")  # no cluster of the user's is looked at
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    captured = capsys.readouterr()
    assert err.value.code == 2, (err.value.code, captured.err)
    assert names in captured.err, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not Path(NO).exists()  # nothing made where the bad input pointed
