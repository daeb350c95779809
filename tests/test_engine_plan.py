"""What each instance is started with, derived from the spec (no engine started)."""

from __future__ import annotations

from pdcluster.cluster.instance_plan import CONNECTOR_CLASS, CONNECTOR_MODULE, plan_instance
from pdcluster.cluster.vllm_patches import engine_env
from pdcluster.proto.spec import parse_spec
from pdcluster.transfer.network import InstanceAddress


def spec(**overrides):
    data = {"name": "c", "model": {"path": "/m", "name": "tiny"},
            "prefill": {"instances": 2, "resources": {"cpu_bind": ["0", "0-1"]}},
            "decode": {"instances": 1, "engine": {"max_num_seqs": 8}, "resources": {"cpu_bind": ["1"]}},
            "transfer": {"base_port": 19000, "lease_s": 7, "timeout_s": 3, "on_failure": "recompute"}}
    data.update(overrides)
    return parse_spec(data)


def test_prefill_instance_is_a_producer_on_its_own_port():
    p = plan_instance(spec(), "prefill", 1)
    kv = p.engine_args["kv_transfer_config"]
    assert (p.name, p.engine_id, p.kv_address) == ("prefill-1", "c-prefill-1", "127.0.0.1:19001")
    assert kv["kv_role"] == "kv_producer" and kv["engine_id"] == "c-prefill-1"
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
    assert kv["kv_connector_extra_config"] == {"host": "127.0.0.1", "advertise_host": "127.0.0.1", "port": 19001,
                                               "lease_s": 7.0,
                                               "timeout_s": 3.0, "chunk_bytes": 1 << 20,
                                               "break_prefix": None, "channel_backend": "gloo",
                                               "encrypt": False}
    assert kv["kv_load_failure_policy"] == "recompute"
    assert p.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                     **engine_env(["exit_with_parent", "kv_events_curve", "fork_worker"])}
    assert "secret" not in str(p.engine_args)  # vLLM logs its config: the secret goes by env (EngineActor)


def test_decode_instance_is_a_consumer_with_its_role_overrides():
    d = plan_instance(spec(), "decode", 0)
    assert d.kv_port is None and d.engine_args["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert d.engine_args["max_num_seqs"] == 8
    assert plan_instance(spec(), "prefill", 0).engine_args["max_num_seqs"] == 64
    assert d.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_engine_args_are_what_vllm_needs():
    args = plan_instance(spec(), "prefill", 0).engine_args
    assert args["skip_tokenizer_init"] is True  # the router tokenizes
    assert args["enable_prefix_caching"] is True and args["block_size"] == 128
    assert (args["model"], args["served_model_name"]) == ("/m", "tiny")


def test_a_host_tier_reaches_ps_connector_in_bytes():
    p = plan_instance(spec(prefill={"instances": 2, "engine": {"host_tier_gib": 0.5}}), "prefill", 0)
    assert p.engine_args["kv_transfer_config"]["kv_connector_extra_config"]["host_tier_bytes"] == 1 << 29


def test_a_retention_hint_goes_to_both_connectors_in_kv_transfer_params():
    from pdcluster.cluster.engine_actor import decode_kv_params, prefill_kv_params
    from pdcluster.proto.handle import PRODUCE_KEY, RETAIN_KEY, TransferHandle
    from pdcluster.proto.messages import DecodeRequest, SamplingSpec

    assert prefill_kv_params("pdc", "t1", 600.0) == {PRODUCE_KEY: "t1", RETAIN_KEY: 600.0}
    assert prefill_kv_params("pdc", "t1") == {PRODUCE_KEY: "t1"}
    handle = TransferHandle("p0", "127.0.0.1:5000", "t1", 10)
    kept = SamplingSpec(retain_s=600.0)
    assert decode_kv_params("pdc", DecodeRequest("r", [1], kept, handle)) == {**handle.to_params(), RETAIN_KEY: 600.0}
    assert decode_kv_params("pdc", DecodeRequest("r", [1], kept, None)) == {RETAIN_KEY: 600.0}  # D prefills it
    assert decode_kv_params("pdc", DecodeRequest("r", [1], SamplingSpec(), None)) is None


def test_error_policy_and_extra_args():
    p = plan_instance(spec(transfer={"on_failure": "error"}, engine={"extra": {"swap_space": 0}}), "decode", 0)
    assert p.engine_args["kv_transfer_config"]["kv_load_failure_policy"] == "fail"
    assert p.engine_args["swap_space"] == 0


def test_nixl_connector_instead_of_ours():
    s = spec(transfer={"connector": "nixl", "base_port": 19000})
    p, d = plan_instance(s, "prefill", 1), plan_instance(s, "decode", 0)
    for inst in (p, d):
        kv = inst.engine_args["kv_transfer_config"]
        assert (kv["kv_connector"], kv["kv_role"], kv["kv_buffer_device"]) == ("NixlConnector", "kv_both", "cpu")
        # The CPU fixes (cluster/vllm_patches.py), loaded by cluster/vllm_site/sitecustomize.py.
        assert inst.env["PYTHONPATH"].split(":")[0].endswith("cluster/vllm_site")
        assert inst.env["PDC_PATCH_NIXL_CPU"] == "1" and "PDC_PATCH_DSV4_CPU" not in inst.env
    # A side channel per engine: P i on base + i, D j after the P instances.
    assert (p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"], d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("19001", "19002")
    assert (p.kv_address, d.kv_address) == ("127.0.0.1:19001", "127.0.0.1:19002")


def test_nixl_ports_cover_decode_instances_too():
    import pytest

    from pdcluster.proto.spec import SpecError

    with pytest.raises(SpecError, match=r"router.port \(19002\) falls in the KV ports 19000..19002"):
        spec(transfer={"connector": "nixl", "base_port": 19000}, router={"port": 19002})
    spec(transfer={"connector": "pdc", "base_port": 19000}, router={"port": 19002})  # ours: P ports only


def test_torch_dist_backend_is_chosen_by_device():
    base = {"base_port": 19000, "backend": "torch_dist"}
    for device, backend, res in (("cpu", "gloo", {}), ("cuda", "nccl", {"gpus": 1}), ("npu", "hccl", {"npus": 1})):
        roles = {r: {"instances": 1, "resources": res} for r in ("prefill", "decode")}
        extra = plan_instance(spec(device=device, transfer=base, **roles), "prefill", 0).engine_args[
            "kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["channel_backend"] == backend and "transport" not in extra, device  # the router's handle names it


def test_every_instance_publishes_kv_events_on_its_own_ports():
    s = spec(router={"kv_events_port": 18800})
    # P first, then D; two ports each (publish, replay), as ClusterSpec.kv_event_ports numbers them.
    want = {("prefill", 0): (18800, 18801), ("prefill", 1): (18802, 18803), ("decode", 0): (18804, 18805)}
    for (role, index), (pub, replay) in want.items():
        ev = plan_instance(s, role, index).engine_args["kv_events_config"]
        assert ev == dict(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub}",
                          replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv")
    from vllm.config.kv_events import KVEventsConfig

    address = InstanceAddress("10.0.0.5", "10.0.0.5")
    cfg = KVEventsConfig(**plan_instance(s, "decode", 0, address).engine_args["kv_events_config"])  # as EngineActor
    assert (cfg.enable_kv_cache_events, cfg.publisher, cfg.endpoint) == (True, "zmq", "tcp://10.0.0.5:18804")


def test_an_instance_binds_its_address_and_advertises_the_chosen_one():
    bind_all = InstanceAddress("0.0.0.0", "10.0.0.5")
    p = plan_instance(spec(), "prefill", 1, bind_all)
    extra = p.engine_args["kv_transfer_config"]["kv_connector_extra_config"]
    assert (extra["host"], extra["advertise_host"], p.kv_address) == ("0.0.0.0", "10.0.0.5", "10.0.0.5:19001")
    nixl = plan_instance(spec(transfer={"connector": "nixl", "base_port": 19000}), "decode", 0, bind_all)
    assert nixl.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"
