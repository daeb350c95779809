"""The cluster spec: the shipped deploy files load, roles inherit the shared engine
args, and every invalid spec raises SpecError naming the field that is wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdcluster.proto.spec import ClusterSpec, SpecError, load_spec, parse_spec

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def minimal(**changes) -> dict:
    """A valid minimal spec dict; each keyword replaces one top-level section."""
    data = {
        "model": {"path": "/models/tiny"},
        "device": "cpu",
        "engine": {"block_size": 128, "max_model_len": 1024, "max_num_batched_tokens": 1024},
        "prefill": {"instances": 1},
        "decode": {"instances": 1},
        "transfer": {"base_port": 18600},
        "router": {"port": 8000},
    }
    data.update(changes)
    return data


def spec_error(data) -> str:
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    return str(exc.value)


def test_minimal_is_valid():
    spec = parse_spec(minimal())
    assert isinstance(spec, ClusterSpec)
    assert spec.model.path == "/models/tiny"
    assert spec.model.served_name == "tiny"


# --- the shipped deploy files -------------------------------------------------------

@pytest.mark.parametrize("name", ["p1d1-tiny-cpu.yaml", "p2d2-tiny-cpu.yaml", "p8d8-npu.yaml"])
def test_deploy_files_load(name):
    spec = load_spec(DEPLOY / name)
    assert spec.role_engine("prefill") == spec.role_engine("decode")
    assert spec.role_engine("prefill").block_size == 128


def test_p1d1_tiny_cpu():
    spec = load_spec(DEPLOY / "p1d1-tiny-cpu.yaml")
    assert spec.device == "cpu"
    assert (spec.prefill.instances, spec.decode.instances) == (1, 1)
    assert spec.prefill.resources.cpu_bind == ["0"]
    assert spec.decode.resources.cpu_bind == ["1"]
    assert spec.model.tiny is not None and spec.model.tiny.arch == "qwen3" and spec.model.tiny.seed == 0
    assert spec.model.served_name == "tiny-qwen3"
    # A relative model path resolves against the current directory.
    assert spec.model.path == str(Path.cwd() / ".pdcluster/models/tiny-qwen3")
    eng = spec.role_engine("decode")
    assert (eng.max_model_len, eng.max_num_batched_tokens, eng.kv_cache_space_gib) == (8192, 8192, 1.0)
    assert (eng.dtype, eng.enforce_eager) == ("float32", True)
    assert (spec.transfer.lease_s, spec.transfer.timeout_s, spec.transfer.on_failure) == (60, 30, "error")
    assert (spec.router.host, spec.router.port) == ("127.0.0.1", 8000)


def test_an_unset_router_host_is_loopback_or_the_routers_own_host():
    """Issue 28 item 5: a router router.labels put on another host listens on that host's address."""
    from pdcluster.proto.spec_sections import RouterSpec

    assert RouterSpec().host is None and RouterSpec().bind_host("10.0.0.7") == "127.0.0.1"
    assert RouterSpec(labels={"pdc-host": "b"}).bind_host("10.0.0.7") == "10.0.0.7"
    assert RouterSpec(labels={"pdc-host": "b"}, host="0.0.0.0").bind_host("10.0.0.7") == "0.0.0.0"


def test_p2d2_tiny_cpu():
    spec = load_spec(DEPLOY / "p2d2-tiny-cpu.yaml")
    assert (spec.prefill.instances, spec.decode.instances) == (2, 2)
    assert spec.prefill.resources.cpu_bind == ["0", "0"]
    assert spec.decode.resources.cpu_bind == ["1", "1"]
    assert spec.role_engine("prefill").kv_cache_space_gib == 1


def test_p8d8_npu():
    spec = load_spec(DEPLOY / "p8d8-npu.yaml")
    assert spec.device == "npu"
    assert spec.ray_address == "auto"
    assert (spec.prefill.instances, spec.decode.instances) == (8, 8)
    assert spec.prefill.resources.npus == 1 and spec.decode.resources.npus == 1
    assert spec.model.tiny is None
    assert spec.model.path == "/models/DeepSeek-V4-Flash"
    eng = spec.role_engine("prefill")
    assert (eng.max_model_len, eng.max_num_batched_tokens, eng.dtype) == (131072, 131072, "bfloat16")
    assert (spec.transfer.lease_s, spec.transfer.timeout_s, spec.transfer.on_failure) == (120, 60, "recompute")
    assert (spec.router.host, spec.router.port) == ("0.0.0.0", 8000)
    assert spec.prefill.placement.labels_of(7) == {"pdc-role": "prefill"}
    assert spec.decode.placement.labels_of(0) == {"pdc-role": "decode"}
    assert (spec.network.mode, spec.network.cidr) == ("auto", "10.0.0.0/8")


# --- role engine merging --------------------------------------------------------------

def test_role_override_wins_and_the_rest_inherits():
    spec = parse_spec(minimal(
        engine={"block_size": 128, "max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 8},
        prefill={"engine": {"max_num_seqs": 2, "kv_cache_space_gib": 3}},
    ))
    p, d = spec.role_engine("prefill"), spec.role_engine("decode")
    assert (p.max_num_seqs, p.kv_cache_space_gib) == (2, 3.0)
    assert (d.max_num_seqs, d.kv_cache_space_gib) == (8, 1.0)  # 1.0: the built-in default
    assert (p.block_size, p.max_model_len, p.max_num_batched_tokens) == (128, 1024, 1024)


def test_unset_shared_fields_take_the_defaults():
    spec = parse_spec(minimal(engine={"dtype": "float32"}))
    eng = spec.role_engine("prefill")
    assert (eng.dtype, eng.block_size, eng.max_model_len, eng.enable_prefix_caching) == ("float32", 128, 8192, True)


def test_extra_merges_key_by_key():
    spec = parse_spec(minimal(
        engine={"extra": {"a": 1, "b": 2}},
        decode={"engine": {"extra": {"b": 3, "c": 4}}},
    ))
    assert spec.role_engine("decode").extra == {"a": 1, "b": 3, "c": 4}
    assert spec.role_engine("prefill").extra == {"a": 1, "b": 2}


def test_explicit_null_inherits():
    spec = parse_spec(minimal(
        engine={"max_model_len": None},
        decode={"engine": {"block_size": None}},
    ))
    d = spec.role_engine("decode")
    assert (d.max_model_len, d.block_size) == (8192, 128)


# --- validation errors name their field -----------------------------------------------

def test_unknown_field():
    msg = spec_error(minimal(engine={"block_sise": 64}))
    assert "engine.block_sise: Extra inputs are not permitted" in msg


def test_unknown_field_in_a_role():
    msg = spec_error(minimal(decode={"instance": 2}))
    assert "decode.instance: Extra inputs are not permitted" in msg


def test_unknown_top_level_field():
    assert "routr: Extra inputs are not permitted" in spec_error(minimal(routr={"port": 9000}))


def test_zero_instances():
    msg = spec_error(minimal(prefill={"instances": 0}))
    assert "prefill.instances: 0 leaves nobody to prefill" in msg  # unless D prefills all (test_routing_colocated)
    assert "decode.instances: at least 1" in spec_error(minimal(decode={"instances": 0}))
    assert "prefill.instances: Input should be greater than or equal to 0" in spec_error(
        minimal(prefill={"instances": -1}))


def test_negative_lease():
    msg = spec_error(minimal(transfer={"lease_s": -1}))
    assert "transfer.lease_s: Input should be greater than 0" in msg


def test_zero_block_size_in_a_role():
    msg = spec_error(minimal(decode={"engine": {"block_size": 0}}))
    assert "decode.engine.block_size: Input should be greater than 0" in msg


def test_wrong_type():
    msg = spec_error(minimal(engine={"max_model_len": "long"}))
    assert "engine.max_model_len: Input should be a valid integer" in msg


def test_wrong_literal():
    msg = spec_error(minimal(device="tpu"))
    assert re.search(r"^  device: Input should be 'cpu', 'cuda' or 'npu'", msg, re.M)


def test_all_errors_are_listed():
    msg = spec_error(minimal(prefill={"instances": -1}, transfer={"timeout_s": 0}))
    assert "prefill.instances" in msg and "transfer.timeout_s" in msg


def test_block_size_mismatch():
    msg = spec_error(minimal(decode={"engine": {"block_size": 64}}))
    assert "prefill.engine.block_size (128) != decode.engine.block_size (64)" in msg


def test_dtype_mismatch():
    msg = spec_error(minimal(prefill={"engine": {"dtype": "bfloat16"}}))
    assert "prefill.engine.dtype (bfloat16) != decode.engine.dtype (auto)" in msg


def test_decode_shorter_than_prefill():
    msg = spec_error(minimal(decode={"engine": {"max_model_len": 512}}))
    assert "decode.engine.max_model_len (512) < prefill.engine.max_model_len (1024)" in msg


def test_a_host_tier_runs_through_our_connector_only():
    assert "decode.engine.host_tier_gib: a host KV tier needs transfer.connector: pdc" in \
        spec_error(minimal(decode={"engine": {"host_tier_gib": 1}}, transfer={"connector": "nixl"}))
    assert "prefill.engine.host_tier_gib: a host KV tier needs transfer.connector: pdc" in spec_error(
        minimal(prefill={"engine": {"host_tier_gib": 1}}, transfer={"connector": "nixl"}))
    assert "host_tier_gib" in spec_error(minimal(engine={"host_tier_gib": -1}))
    both = ClusterSpec.model_validate(minimal(engine={"host_tier_gib": 0.5}))
    assert both.role_engine("prefill").host_tier_gib == both.role_engine("decode").host_tier_gib == 0.5


def test_prefix_caching_off():
    msg = spec_error(minimal(decode={"engine": {"enable_prefix_caching": False}}))
    assert "decode.engine.enable_prefix_caching: must be true" in msg


def test_batched_tokens_below_model_len():
    msg = spec_error(minimal(prefill={"engine": {"max_num_batched_tokens": 512}}))
    assert "prefill.engine.max_num_batched_tokens (512) < max_model_len (1024)" in msg


def test_cpu_bind_length():
    msg = spec_error(minimal(prefill={"instances": 2, "resources": {"cpu_bind": ["0"]}}))
    assert "prefill.resources.cpu_bind has 1 entries for prefill.instances (2)" in msg


def test_gpus_on_cpu():
    msg = spec_error(minimal(decode={"resources": {"gpus": 1}}))
    assert "decode.resources.gpus (1) set but device is 'cpu'" in msg


def test_npu_without_npus():
    msg = spec_error(minimal(device="npu", decode={"resources": {"npus": 1}}))
    assert "prefill.resources.npus: device 'npu' needs at least 1 per instance" in msg


def test_npu_with_npus_is_valid():
    spec = parse_spec(minimal(device="npu", prefill={"resources": {"npus": 1}}, decode={"resources": {"npus": 2}}))
    assert spec.decode.resources.npus == 2


def test_cuda_without_gpus():
    msg = spec_error(minimal(device="cuda"))
    assert "prefill.resources.gpus: device 'cuda' needs at least 1 per instance" in msg


def test_router_port_in_kv_ports():
    msg = spec_error(minimal(prefill={"instances": 4}, router={"port": 18603}))
    assert "router.port (18603) falls in the KV ports 18600..18603" in msg


def test_router_port_just_past_kv_ports_is_valid():
    assert parse_spec(minimal(prefill={"instances": 4}, router={"port": 18604})).router.port == 18604


def test_router_processes_at_least_one():
    assert parse_spec(minimal(router={"port": 8000, "processes": 4})).router.processes == 4
    msg = spec_error(minimal(router={"port": 8000, "processes": 0}))
    assert "router.processes" in msg and "greater than or equal to 1" in msg


def test_missing_model():
    data = minimal()
    del data["model"]
    assert re.search(r"^  model: Field required", spec_error(data), re.M)


def test_missing_model_path():
    assert "model.path: Field required" in spec_error(minimal(model={"name": "x"}))


def test_unknown_tiny_arch():
    msg = spec_error(minimal(model={"path": "/m", "tiny": {"arch": "gpt2"}}))
    assert "model.tiny.arch: Input should be 'qwen3', 'llama', 'gemma3', 'gptoss' or 'dsv4'" in msg


def test_parse_not_a_mapping():
    with pytest.raises(SpecError, match="the top level must be a mapping, got list"):
        parse_spec([1, 2])


# --- files ------------------------------------------------------------------------------

def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: /m}\nprefill: {instances: 0}\n")
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert str(exc.value).startswith(f"{path}: invalid cluster spec")
    assert "prefill.instances" in str(exc.value)


def test_load_relative_model_path(tmp_path, monkeypatch):
    path = tmp_path / "ok.yaml"
    path.write_text("model: {path: models/m}\n")
    monkeypatch.chdir(tmp_path)
    assert load_spec(path).model.path == str(tmp_path / "models" / "m")


def test_load_yaml_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- engine\n")
    with pytest.raises(SpecError, match="the top level must be a mapping, got list"):
        load_spec(path)


def test_load_empty_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with pytest.raises(SpecError, match="the spec is empty"):
        load_spec(path)


def test_load_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: {path: /m\nengine: [\n")
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert str(exc.value).startswith(f"{path}: not valid YAML")


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert str(exc.value) == f"{path}: no such file"


def test_load_directory(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path)


@pytest.mark.parametrize("transfer, words", [
    ({"connector": "nixl", "mode": "push"}, "mode: push needs connector pdc"),
    ({"connector": "nixl", "backend": "torch_dist"}, "backend: torch_dist needs connector pdc"),
    ({"mode": "sideways"}, "transfer.mode"),
])
def test_transfer_mode_and_backend_checked(transfer, words):
    assert words in spec_error(minimal(transfer=transfer))


def test_transfer_mode_defaults_per_connector():
    assert parse_spec(minimal()).transfer.mode == "push"
    assert parse_spec(minimal(transfer={"connector": "nixl"})).transfer.mode == "pull"


# --- engine kind, sim section, routing ----------------------------------------------

def test_engine_sim_shorthand_needs_a_sim_section():
    assert "engine: sim needs a `sim:` section" in spec_error(minimal(engine="sim"))


def test_engine_sim_with_a_shipped_params_name_that_does_not_exist():
    assert "sim.params: no shipped parameter file 'nope'" in spec_error(minimal(engine="sim", sim={"params": "nope"}))


def test_engine_sim_with_a_params_path(tmp_path):
    params = tmp_path / "p.yaml"
    spec = parse_spec(minimal(engine="sim", sim={"params": str(params), "payload_scale": 64}))
    assert spec.role_engine("prefill").kind == "sim" and spec.role_engine("prefill").block_size == 128
    assert spec.sim.params == str(params) and spec.sim.payload_scale == 64


def test_sim_kv_blocks_per_instance_or_per_role(tmp_path):
    params = str(tmp_path / "p.yaml")
    one = parse_spec(minimal(engine="sim", sim={"params": params, "kv_blocks": 64}))
    assert one.sim.kv_blocks_of("prefill") == one.sim.kv_blocks_of("decode") == 64
    split = parse_spec(minimal(engine="sim", sim={"params": params, "kv_blocks": {"prefill": 32}},
                               decode={"engine": {"host_tier_gib": 2}}))
    assert (split.sim.kv_blocks_of("prefill"), split.sim.kv_blocks_of("decode")) == (32, None)
    assert split.role_engine("decode").host_tier_gib == 2 and not split.role_engine("prefill").host_tier_gib
    assert "sim.kv_blocks" in spec_error(minimal(engine="sim", sim={"params": params, "kv_blocks": {"prefil": 32}}))
    assert "sim.kv_blocks" in spec_error(minimal(engine="sim", sim={"params": params, "kv_blocks": 0}))


def test_p_and_d_engine_kinds_must_agree():
    data = minimal(sim={"params": "/x.yaml"}, decode={"instances": 1, "engine": {"kind": "sim"}})
    assert "prefill.engine.kind (vllm) != decode.engine.kind (sim)" in spec_error(data)


def test_unknown_policy_is_named():
    assert "router.policy" in spec_error(minimal(router={"port": 8000, "policy": "random"}))


def test_kv_event_ports_two_per_instance_p_first():
    spec = parse_spec(minimal(prefill={"instances": 2}, decode={"instances": 2},
                              router={"port": 8000, "kv_events_port": 19000}))
    assert spec.kv_event_ports("prefill", 1) == (19002, 19003)
    assert spec.kv_event_ports("decode", 0) == (19004, 19005)


def test_kv_event_ports_must_not_overlap_kv_ports():
    data = minimal(router={"port": 8000, "kv_events_port": 18600})
    assert "router.kv_events_port" in spec_error(data) and "overlap the KV ports" in spec_error(data)
