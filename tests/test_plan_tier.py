"""`pdc plan --tier-gib`: each host KV tier size tried on the best configuration, the table's tier
column, what each size buys beside the answer, and the written spec carrying the chosen size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdcluster.cluster.cli import main
from pdcluster.cluster.sim.plan import configure
from pdcluster.cluster.sim.plan_types import Config
from pdcluster.proto.spec import load_spec, parse_spec

TIERED = Path(__file__).resolve().parents[1] / "deploy" / "p8d8-sim-tiered.yaml"
# The C90 shape with 64 families (each P's ~8 through a cache of ~3): a short formal window.
LOAD = ["--spec", str(TIERED), "--preset", "c90", "--num-prefixes", "64", "--num-requests", "64", "--vocab-size", "1000"]


def test_a_configuration_sets_every_instances_tier_or_none():
    base = load_spec(TIERED)
    for gib, want in ((16, 16), (0, None)):
        spec = configure(base, Config(8, 8, 16384, 16, "prefix_aware", None, host_tier_gib=gib))
        assert spec.role_engine("prefill").host_tier_gib == spec.role_engine("decode").host_tier_gib == want
    kept = configure(base, Config(8, 8, 16384, 16, "prefix_aware", None))
    assert kept.role_engine("decode").host_tier_gib == base.role_engine("decode").host_tier_gib == 64


def test_the_plan_says_what_each_tier_size_buys_and_writes_the_chosen_one(tmp_path, capsys):
    out, written = tmp_path / "plan", tmp_path / "chosen.yaml"
    main(["plan", "dsv4-flash-910c", "--devices", "16", *LOAD, "--splits", "8", "--tier-gib", "0,8",
          "--slo-ttft-ms", "5000", "--no-twin", "--headroom", "none", "--out", str(out), "--write-spec", str(written)])
    text = capsys.readouterr().out
    assert "tier GiB" in text
    assert "what the host tier buys: 0 GiB: hit 0.0%" in text and "8 GiB: hit 90.6%" in text
    chosen = json.loads((out / "plan.json").read_text())["chosen"]["config"]
    assert chosen["host_tier_gib"] == 8
    spec = parse_spec(yaml.safe_load(written.read_text().split("\n", 1)[1]), str(written))
    assert spec.role_engine("prefill").host_tier_gib == spec.role_engine("decode").host_tier_gib == 8


@pytest.mark.parametrize("params, tiers, message", [
    ("dsv4-flash-910c", "-1", "--tier-gib -1.0: sizes in GiB, 0 (no tier) or more"),
    ("dsv4-flash-910c", "x", "--tier-gib 'x': a comma-separated list of float values"),
    ("qwen3-0.6b-h200", "8", "qwen3-0.6b-h200: no host_link"),
])
def test_bad_tier_sizes_are_refused_naming_the_problem(tmp_path, capsys, params, tiers, message):
    with pytest.raises(SystemExit) as err:
        main(["plan", params, "--devices", "16", *LOAD, "--splits", "8", "--tier-gib", tiers, "--slo-ttft-ms", "5000",
              "--no-twin", "--headroom", "none", "--out", str(tmp_path)])
    assert err.value.code == 2 and message in capsys.readouterr().err
