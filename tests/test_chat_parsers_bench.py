"""bench/chat_parsers.py runs: each case answers (a tool call parsed, streamed and not) and is measured."""

from __future__ import annotations

from e2e import tiny_model_dir

from pdcluster.bench.chat_parsers import main


def test_each_case_answers_and_is_measured(capsys):
    assert main(["--model", tiny_model_dir(), "--requests", "3", "--rounds", "1"]) == 0
    rows = [line.rsplit(maxsplit=2) for line in capsys.readouterr().out.splitlines()
            if line.startswith(("plain chat", "tools auto"))]
    assert len(rows) == 4 and all(float(r[2]) > 0 for r in rows)
