"""What one P or D instance's vLLM engine is started with, derived from the spec: its engine args
(our connector, or vLLM's NIXL; its KV-event publisher; the worker extension the actor asks through), its env (the
run-time vLLM patches, CPU binding), its KV port. Pure functions: unit-tested without an engine;
cluster/engine_actor.py starts the engine from an `InstancePlan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.cluster.vllm_patches import engine_env, patch_sets_for_device, patch_sets_for_model
from pdcluster.proto.devices import DEVICES
from pdcluster.proto.kv_event_wire import engine_kv_events_config
from pdcluster.proto.messages import Role
from pdcluster.proto.spec import ClusterSpec
from pdcluster.transfer.network import LOOPBACK_ADDRESS, InstanceAddress, host_port
from pdcluster.transfer.pool_worker import EXTENSION as POOL_EXTENSION

CONNECTOR_MODULE = "pdcluster.transfer.connector"
CONNECTOR_CLASS = "PdcConnector"


@dataclass(frozen=True)
class InstancePlan:
    """Everything one instance needs to start, derived from the spec."""

    name: str
    role: Role
    index: int
    engine_id: str
    engine_args: dict[str, Any]
    env: dict[str, str]
    kv_port: int | None  # P's KV server (ours), or the engine's NIXL side channel
    address: InstanceAddress = LOOPBACK_ADDRESS  # what its planes bind, and advertise

    @property
    def kv_address(self) -> str | None:
        return host_port(self.address.advertise, self.kv_port) if self.kv_port is not None else None


def plan_instance(spec: ClusterSpec, role: Role, index: int,
                  address: InstanceAddress = LOOPBACK_ADDRESS) -> InstancePlan:
    """`address`: where this instance's planes bind and what they advertise (transfer/network.py)."""
    eng = spec.role_engine(role)
    name = f"{role}-{index}"
    engine_id = f"{spec.name}-{name}"
    kv_port = spec.kv_port(role, index)
    extra = {
        "host": address.bind,
        "advertise_host": address.advertise,
        "port": kv_port or 0,
        "lease_s": spec.transfer.lease_s,
        "timeout_s": spec.transfer.timeout_s,
        "chunk_bytes": spec.transfer.chunk_bytes,
        "break_prefix": spec.transfer.break_transfers_with_prefix,
        "encrypt": spec.transfer.encrypt,
        # P serves torch_dist transfers over this backend when a handle asks for them.
        "channel_backend": DEVICES[spec.device].collective_backend,
    }
    if eng.host_tier_gib and spec.transfer.connector == "pdc":
        extra["host_tier_bytes"] = int(eng.host_tier_gib * 2**30)
    args: dict[str, Any] = dict(
        model=spec.model.path,
        served_model_name=spec.model.served_name,
        # The router tokenizes; D loads the tokenizer only for what vLLM compiles with it (structured outputs).
        skip_tokenizer_init=role == "prefill",
        # D's structured outputs start where its reasoning ends, as vllm serve's --reasoning-parser has them.
        **({"reasoning_parser": spec.model.reasoning_parser} if role == "decode" and spec.model.reasoning_parser else {}),
        block_size=eng.block_size,
        max_model_len=eng.max_model_len,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        max_num_seqs=eng.max_num_seqs,
        enable_prefix_caching=eng.enable_prefix_caching,
        dtype=eng.dtype,
        enforce_eager=eng.enforce_eager,
        kv_transfer_config=dict(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            engine_id=engine_id,
            kv_load_failure_policy="recompute" if spec.transfer.on_failure == "recompute" else "fail",
            kv_connector_extra_config=extra,
        ),
        # Every instance publishes its KV cache events (the router's prefix index, router/kv_events.py).
        kv_events_config=engine_kv_events_config(spec, role, index, address.bind),
    )
    if spec.transfer.connector == "pdc":  # the actor asks the worker: its KV groups, its tier (transfer/pool_worker.py)
        args["worker_extension_cls"] = POOL_EXTENSION
    if eng.seed is not None:
        args["seed"] = eng.seed
    if eng.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = eng.gpu_memory_utilization
    args.update(eng.extra)

    device = DEVICES[spec.device]
    env: dict[str, str] = {}
    # Run-time vLLM fixes (cluster/vllm_patches.py): every engine's, the model's, NIXL's on CPU.
    patch_sets = ["exit_with_parent", "kv_events_curve", *patch_sets_for_device(spec.device),
                  *patch_sets_for_model(spec.model.path, spec.device)]
    if spec.transfer.connector == "nixl":
        _use_nixl(spec, kv_port, engine_id, address.advertise, args, env)
        patch_sets.append("nixl")
        if spec.device == "cpu":
            patch_sets.append("nixl_cpu")
    env.update(engine_env(patch_sets))
    if spec.device == "cpu" and eng.kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(eng.kv_cache_space_gib)
    bind = getattr(spec, role).resources.cpu_bind
    if bind is not None and device.bind_env is not None:
        env[device.bind_env] = bind[index]
    return InstancePlan(name, role, index, engine_id, args, env, kv_port, address)


def _use_nixl(spec: ClusterSpec, port: int, engine_id: str, host: str, args: dict, env: dict) -> None:
    """vLLM's NixlConnector instead of ours: both roles kv_both, a side channel per engine
    on host:port (spec.kv_port). vLLM's side channel has no authentication of its own."""
    args["kv_transfer_config"] = dict(
        kv_connector="NixlConnector", kv_role="kv_both", engine_id=engine_id,
        kv_load_failure_policy=args["kv_transfer_config"]["kv_load_failure_policy"],
        **({"kv_buffer_device": "cpu"} if spec.device == "cpu" else {}))
    env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=host, VLLM_NIXL_SIDE_CHANNEL_PORT=str(port))
