"""Devices per instance (issue 27 item 4): a parameter file's `parallel` section says how an
instance's times scale with its tensor parallel degree (cluster/sim/cost.py), the simulated engine
runs at the spec's `sim.devices_per_instance`, and `pdc plan --devices-per-instance` sweeps it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdcluster.cluster.cli import main
from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.cost import CostModel, SimParams, SimParamsError
from pdcluster.cluster.sim.plan import configure, plan
from pdcluster.cluster.sim.plan_types import Config, Slo
from pdcluster.proto.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
PARAMS, DEPLOY = ROOT / "cluster" / "sim" / "params", ROOT / "deploy"
LOAD = ["--input-len", "32772", "--shared-prefix-ratio", str(29 * 1024 / 32772), "--output-len", "32",
        "--num-prefixes", "6", "--num-requests", "36", "--max-concurrency", "16", "--request-rate", "6"]


def load(name: str) -> SimParams:
    return SimParams.load(PARAMS / f"{name}.yaml")


def with_parallel(name: str, **changes) -> SimParams:
    p = load(name)
    return p.model_copy(update={"parallel": p.parallel.model_copy(update=changes)})


def test_one_device_is_the_files_own_model_to_the_bit():
    p = load("qwen3-0.6b-h200")
    bare = CostModel(p.model_copy(update={"parallel": None}), 128)
    one = CostModel(p, 128, 1)
    for chunks, contexts in (([(16384, 0)], []), ([(2048, 100_000)], [5000, 70_000]), ([], [131_072] * 16)):
        assert one._step_s(chunks, contexts) == bare._step_s(chunks, contexts)
    assert (one.kv_capacity_blocks(), one.transfer_s(10**9)) == (bare.kv_capacity_blocks(), bare.transfer_s(10**9))


def test_two_devices_split_the_compute_and_the_weights_and_add_the_all_reduces():
    # No overheads and no weights' read: the step is its compute (and, at 2 devices, its all-reduces).
    p = load("qwen3-0.6b-h200")
    p = p.model_copy(update={"overheads": p.overheads.model_copy(update={"prefill_step_s": 0.0}),
                             "model": p.model.model_copy(update={"weight_bytes_per_step": 1.0})})
    par = p.parallel
    one, two = CostModel(p, 128, 1), CostModel(p, 128, 2)
    # The context's KV read once per layer: each device reads its half of the (sharded) KV.
    read_1 = (one.step_work([(16384, 0)], []).context_read_bytes
              / (p.device.hbm_bytes_per_s * p.efficiency.prefill_kv_read))
    compute_1 = one.prefill_step_s([(16384, 0)]) - read_1
    all_reduce = par.collective_latency_s + 2 * (2 - 1) / 2 * 16384 * par.hidden_bytes / par.collective_bytes_per_s
    want = compute_1 / (2 * par.efficiency[2]) + read_1 / 2 + p.model.layers * par.collectives_per_layer * all_reduce
    assert two.prefill_step_s([(16384, 0)]) == pytest.approx(want, rel=1e-12)
    assert two.transfer_s(10**9) == pytest.approx(p.link.latency_s + 10**9 / (2 * p.link.bytes_per_s))


def test_kv_memory_grows_with_the_devices_only_where_the_kv_is_sharded():
    per_block = {}
    for name in ("qwen3-0.6b-h200", "dsv4-flash-910c"):
        p = load(name)
        per_block[name] = p.device.kv_cache_bytes / CostModel(p, 128).kv_capacity_blocks()
        freed = p.device.kv_cache_bytes + p.parallel.weight_memory_bytes / 2  # per device, at degree 2
        blocks = CostModel(p, 128, 2).kv_capacity_blocks()
        assert blocks == pytest.approx(freed * (2 if p.parallel.kv_sharded else 1) / per_block[name], abs=1.5)
    assert load("qwen3-0.6b-h200").parallel.kv_sharded and not load("dsv4-flash-910c").parallel.kv_sharded


def test_a_degree_the_file_does_not_price_is_refused_naming_what_it_prices():
    with pytest.raises(SimParamsError, match=r"qwen3-0.6b-h200: 3 devices per instance: its parallel section "
                                             r"prices 1, 2, 4, 8"):
        CostModel(load("qwen3-0.6b-h200"), 128, 3)
    with pytest.raises(SimParamsError, match="tiny-qwen3-cpu: 2 devices per instance: it has no parallel section"):
        CostModel(load("tiny-qwen3-cpu"), 16, 2)


@pytest.mark.parametrize("efficiency, message", [({2: 0.9}, "degree 1 must be listed"),
                                                 ({1: 1.0, 2: 1.5}, "degree 2 -> 1.5")])
def test_a_parallel_section_without_degree_1_or_with_a_share_above_1_is_refused(efficiency, message):
    data = yaml.safe_load((PARAMS / "qwen3-0.6b-h200.yaml").read_text())
    data["parallel"]["efficiency"] = efficiency
    with pytest.raises(SimParamsError, match=r"parallel\.efficiency"):
        SimParams.parse(data, "x.yaml")
    with pytest.raises(SimParamsError, match=message):
        SimParams.parse(data, "x.yaml")


def small_load() -> BenchConfig:
    return BenchConfig(input_len=32772, shared_prefix_ratio=29 * 1024 / 32772, output_len=32, num_prefixes=6,
                       num_requests=36, max_concurrency=16, request_rate=6.0, progress=False)


@pytest.fixture(scope="module")
def by_degree():
    """P1:D3 of one device each beside P1:D1 of two: the same 4 devices."""
    return plan(load_spec(DEPLOY / "p8d8-sim.yaml"), "dsv4-flash-910c", 4, small_load(), Slo(1.5, 0.006),
                "synthetic", {"splits": [1]}, degrees=[1, 2])


def test_the_sweep_crosses_the_degrees_each_on_the_same_devices(by_degree):
    got = {(o.config.devices_per_instance, o.config.prefill, o.config.decode): o for o in by_degree.outcomes}
    assert set(got) == {(1, 1, 3), (2, 1, 1)}
    assert {o.config.devices for o in by_degree.outcomes} == {4}
    # Two devices per P halve its prefill (less the degree's efficiency): the TTFTs differ.
    assert got[(2, 1, 1)].ttft_s != got[(1, 1, 3)].ttft_s
    assert got[(2, 1, 1)].config.label.startswith("P1D1 x2 devices") and got[(2, 1, 1)].config.split == "1:1 x2"


def test_the_configuration_runs_at_its_degree_and_writes_it_for_real_engines():
    c = Config(1, 1, 131072, 16, "prefix_aware", None, devices_per_instance=2)
    sim = configure(load_spec(DEPLOY / "p8d8-sim.yaml"), c)
    assert sim.sim.devices_per_instance == 2
    npu = configure(load_spec(DEPLOY / "p8d8-npu.yaml"), c)
    for role in (npu.prefill, npu.decode):
        assert (role.resources.npus, role.engine.extra["tensor_parallel_size"], role.instances) == (2, 2, 1)
    one = configure(load_spec(DEPLOY / "p8d8-npu.yaml"), Config(1, 1, 131072, 16, "prefix_aware", None))
    assert one.prefill.resources.npus == 1 and "tensor_parallel_size" not in one.prefill.engine.extra


@pytest.mark.parametrize("params, args, message", [
    ("dsv4-flash-910c", ["--devices-per-instance", "3"], "3 devices per instance: its parallel section prices 1, 2, 4, 8"),
    ("dsv4-flash-910c", ["--devices-per-instance", "4", "--devices", "6"], "6 devices make no whole number of instances"),
    ("dsv4-flash-910c", ["--devices-per-instance", "4", "--devices", "4"], "of 4 devices, two or more"),
    ("dsv4-flash-910c", ["--devices-per-instance", ","], "one or more degrees"),
    ("tiny-qwen3-cpu", ["--devices-per-instance", "1,2"], "it has no parallel section"),
])
def test_bad_degrees_are_refused_naming_the_flag(tmp_path, capsys, params, args, message):
    devices = [] if "--devices" in args else ["--devices", "4"]
    with pytest.raises(SystemExit) as err:
        main(["plan", params, *devices, *LOAD, "--slo-ttft-ms", "1500", "--out", str(tmp_path), *args])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_the_plan_json_names_each_configurations_degree(tmp_path):
    out = tmp_path / "plan"
    main(["plan", "dsv4-flash-910c", "--devices", "4", *LOAD, "--splits", "1", "--devices-per-instance", "2",
          "--slo-ttft-ms", "1500", "--no-twin", "--headroom", "none", "--out", str(out)])
    chosen = json.loads((out / "plan.json").read_text())["chosen"]["config"]
    assert (chosen["prefill"], chosen["decode"], chosen["devices_per_instance"]) == (1, 1, 2)
    rerun = yaml.safe_load((out / "configs" / "01.yaml").read_text().split("\n", 1)[1])
    assert rerun["sim"]["devices_per_instance"] == 2
