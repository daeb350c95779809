"""bench/serving_layer.py runs against the installed vLLM (its serving layer's internals move
between versions): both layers answer the same request, and the figures come out."""

from __future__ import annotations

from e2e import tiny_model_dir

from pdcluster.bench.serving_layer import main


def test_both_layers_answer_and_are_measured(capsys):
    assert main(["--model", tiny_model_dir(), "--requests", "5", "--rounds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("pdcluster ", "vLLM "))]
    assert [r[0] for r in rows] == ["pdcluster", "vLLM"] and all(float(r[2]) > 0 and int(r[3]) > 400 for r in rows)
