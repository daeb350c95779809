"""The cluster spec: one YAML file describes a P/D cluster.

`load_spec(path)` parses and validates it before anything starts; every problem
raises `SpecError` whose message names the field (`prefill.engine.block_size`)
and what is wrong with it. P and D are checked against each other: KV blocks move
one to one between them, so whatever shapes a block must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pdcluster.proto.devices import DEVICES
from pdcluster.proto.spec_sections import (  # noqa: F401  (the sections, importable with the spec)
    DEFAULT_ENGINE,
    AuthSpec,
    EngineSpec,
    ModelSpec,
    NetworkSpec,
    ObservabilitySpec,
    PlacementSpec,
    ResourceSpec,
    RoleSpec,
    RouterSpec,
    SimSpec,
    SpecError,
    TinyModelSpec,
    TransferSpec,
    _Strict,
    secret_weakness,
)


class ClusterSpec(_Strict):
    name: str = "pdcluster"  # the cluster's name: its Ray actors (NAME:prefill-0, ...), pdc down --name, run directories
    model: ModelSpec
    device: Literal["cpu", "cuda", "npu"] = "cpu"  # what the engines run on (proto/devices.py; docs/devices.md)
    ray_address: str | None = Field(None, description="join this Ray cluster; default: start a local one")
    partition_tolerance_s: float = Field(
        30.0, gt=0, le=3600,
        description="a host unreachable for less keeps its Ray node and instances (cluster/ray_settings.py); "
                    "`pdc up` starts Ray so, and warns when the Ray it joins declares hosts dead sooner")
    insecure_ray: bool = Field(
        False, description="run on a Ray cluster of several hosts without Ray's token authentication (anyone "
                           "reaching its ports runs code on every host): only on a network no one else reaches")
    engine: EngineSpec = DEFAULT_ENGINE
    sim: SimSpec | None = None
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    transfer: TransferSpec = TransferSpec()
    router: RouterSpec = RouterSpec()
    observability: ObservabilitySpec = ObservabilitySpec()
    network: NetworkSpec = NetworkSpec()
    auth: AuthSpec = AuthSpec()

    def secret(self) -> str:
        """The cluster secret (build_cluster settles it before any actor starts)."""
        assert self.auth.secret is not None, ("no cluster secret in the spec: build_cluster sets one "
                                              "(launch.settle_spec); a component made from an unsettled spec is a bug")
        return self.auth.secret.get_secret_value()

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_kind_shorthand(cls, engine: Any) -> Any:
        # `engine: sim` (or `engine: vllm`): the kind alone, every engine arg at its default.
        return {"kind": engine} if isinstance(engine, str) else engine

    @field_validator("engine")
    @classmethod
    def _fill_engine_defaults(cls, engine: EngineSpec) -> EngineSpec:
        return engine.merged_over(DEFAULT_ENGINE)

    def kv_port(self, role: Literal["prefill", "decode"], index: int) -> int | None:
        """The KV port one instance listens on: P's transfer server (pdc; D has none), or
        either role's NIXL side channel (P first, then D)."""
        if self.transfer.connector == "nixl":
            return self.transfer.base_port + index + (self.prefill.instances if role == "decode" else 0)
        return self.transfer.base_port + index if role == "prefill" else None

    def kv_event_ports(self, role: Literal["prefill", "decode"], index: int) -> tuple[int, int]:
        """(publish, replay) ports of one instance's KV cache events: P first, then D."""
        ordinal = index if role == "prefill" else self.prefill.instances + index
        return self.router.kv_events_port + 2 * ordinal, self.router.kv_events_port + 2 * ordinal + 1

    def role_engine(self, role: Literal["prefill", "decode"]) -> EngineSpec:
        """The engine args one role runs with: its overrides over the shared `engine:`."""
        return getattr(self, role).engine.merged_over(self.engine)

    @model_validator(mode="after")
    def _check_cluster(self) -> ClusterSpec:
        p, d = self.role_engine("prefill"), self.role_engine("decode")
        # A KV block moves one to one: its size and element type must agree.
        for field in ("block_size", "dtype"):
            if getattr(p, field) != getattr(d, field):
                raise ValueError(
                    f"prefill.engine.{field} ({getattr(p, field)}) != decode.engine.{field} "
                    f"({getattr(d, field)}): P and D exchange KV blocks one to one")
        if d.max_model_len < p.max_model_len:
            raise ValueError(f"decode.engine.max_model_len ({d.max_model_len}) < prefill.engine.max_model_len "
                             f"({p.max_model_len}): D could not hold what P prefills")
        if p.kind != d.kind:
            raise ValueError(f"prefill.engine.kind ({p.kind}) != decode.engine.kind ({d.kind}): "
                             f"a real P cannot hand KV to a simulated D or back")
        if p.kind == "sim" and self.sim is None:
            raise ValueError("engine: sim needs a `sim:` section naming its cost-model params "
                             "(e.g. sim: {params: qwen3-0.6b-1dev})")
        if p.kind == "sim" and self.transfer.connector != "pdc":
            raise ValueError(f"transfer.connector: {self.transfer.connector} needs real vLLM engines; "
                             f"the simulated engine moves its state through the pdc transfer")
        if self.decode.instances < 1:
            raise ValueError("decode.instances: at least 1; D serves every request")
        if self.prefill.instances < 1 and self.router.local_prefill.policy != "always":
            raise ValueError("prefill.instances: 0 leaves nobody to prefill; at least 1, or "
                             "router.local_prefill.policy: always (no disaggregation: D prefills every request)")
        if self.prefill.instances < 1 and p.kind != "sim":
            raise ValueError("prefill.instances: 0 (no disaggregation) is modelled on the virtual clock only "
                             "(engine.kind: sim, pdc sim run, pdc plan); a real engine without P is vllm serve")
        for role, eng in (("prefill", p), ("decode", d)):
            if eng.host_tier_gib and self.transfer.connector != "pdc":
                raise ValueError(f"{role}.engine.host_tier_gib: a host KV tier needs transfer.connector: pdc "
                                 f"(it lives in pdcluster's connector)")
        for role in ("prefill", "decode"):
            eng = self.role_engine(role)
            if not eng.enable_prefix_caching:
                raise ValueError(f"{role}.engine.enable_prefix_caching: must be true; "
                                 f"both sides skip what their prefix cache holds")
            # The simulated engine chunks long prompts (vLLM's chunked prefill); real engines here do not.
            if eng.kind != "sim" and eng.max_num_batched_tokens < eng.max_model_len:
                raise ValueError(f"{role}.engine.max_num_batched_tokens ({eng.max_num_batched_tokens}) < "
                                 f"max_model_len ({eng.max_model_len})")
            res, instances = getattr(self, role).resources, getattr(self, role).instances
            if res.cpu_bind is not None and len(res.cpu_bind) != instances:
                raise ValueError(f"{role}.resources.cpu_bind has {len(res.cpu_bind)} entries for "
                                 f"{role}.instances ({instances}): give one per instance")
            device = DEVICES[self.device]
            if device.ray_resource is None and (res.gpus or res.npus):
                which = "gpus" if res.gpus else "npus"
                raise ValueError(f"{role}.resources.{which} ({getattr(res, which)}) set but device is "
                                 f"{self.device!r}")
            if self.device == "cuda" and res.gpus < 1:
                raise ValueError(f"{role}.resources.gpus: device 'cuda' needs at least 1 per instance")
            if self.device == "npu" and res.npus < 1:
                raise ValueError(f"{role}.resources.npus: device 'npu' needs at least 1 per instance")
        # pdc: one KV port per P instance; nixl: a side-channel port per P and D instance.
        n_ports = self.prefill.instances + (self.decode.instances if self.transfer.connector == "nixl" else 0)
        last_kv_port = self.transfer.base_port + n_ports - 1
        if self.transfer.base_port <= self.router.port <= last_kv_port:
            raise ValueError(f"router.port ({self.router.port}) falls in the KV ports "
                             f"{self.transfer.base_port}..{last_kv_port} (transfer.base_port + one per "
                             f"{'instance' if self.transfer.connector == 'nixl' else 'prefill instance'})")
        events = range(self.router.kv_events_port,
                       self.router.kv_events_port + 2 * (self.prefill.instances + self.decode.instances))
        if self.router.port in events:
            raise ValueError(f"router.port ({self.router.port}) falls in the KV event ports "
                             f"{events.start}..{events.stop - 1} (router.kv_events_port + two per instance)")
        if set(events) & set(range(self.transfer.base_port, last_kv_port + 1)):
            raise ValueError(f"router.kv_events_port: its ports {events.start}..{events.stop - 1} (two per "
                             f"instance) overlap the KV ports {self.transfer.base_port}..{last_kv_port}")
        return self


def _field_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid cluster spec"]
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {_field_path(e['loc'])}: {msg}" if e["loc"] else f"  {msg}")
    return "\n".join(lines)


def parse_spec(data: Any, source: str = "<spec>", base_dir: Path | None = None) -> ClusterSpec:
    """Validate a parsed YAML document; relative paths (model, runs) resolve against `base_dir`."""
    if data is None:
        raise SpecError(f"{source}: the spec is empty; it needs at least `model: {{path: ...}}`")
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None
    def resolve(p: str) -> str:
        path = Path(p).expanduser()
        return str((base_dir / path).resolve() if not path.is_absolute() and base_dir is not None else path)

    update = {}
    if spec.sim is not None:
        update["sim"] = spec.sim.model_copy(update={"params": resolve_sim_params(spec.sim.params, resolve)})
    return spec.model_copy(update={
        **update,
        "model": spec.model.model_copy(update={"path": resolve(spec.model.path)}),
        "router": spec.router.model_copy(update={"runs_dir": resolve(spec.router.runs_dir)}),
    })


SHIPPED_SIM_PARAMS = Path(__file__).resolve().parent.parent / "cluster" / "sim" / "params"


def resolve_sim_params(params: str, resolve) -> str:
    """A shipped parameter file's name (no suffix, no slash) or a path; SpecError if missing."""
    if "/" not in params and not params.endswith((".yaml", ".yml")):
        path = SHIPPED_SIM_PARAMS / f"{params}.yaml"
        if not path.exists():
            shipped = sorted(p.stem for p in SHIPPED_SIM_PARAMS.glob("*.yaml"))
            raise SpecError(f"sim.params: no shipped parameter file {params!r}; shipped: {', '.join(shipped)}")
        return str(path)
    return resolve(params)


def read_yaml(path: Path, error: type[Exception]) -> Any:
    """A YAML file's document; `error` (naming the file) if it is missing, unreadable or not YAML."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as err:
        raise error(f"{path}: cannot read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise error(f"{path}: not valid YAML: {err}") from None


def load_spec(path: str | Path) -> ClusterSpec:
    path = Path(path)
    data = read_yaml(path, SpecError)
    # Model paths in a spec are relative to the current directory, as on a command line.
    return parse_spec(data, str(path), base_dir=Path.cwd())
