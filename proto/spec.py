"""The cluster spec: one YAML file describes a P/D cluster.

`load_spec(path)` parses and validates it before anything starts; every problem
raises `SpecError` whose message names the field (`prefill.engine.block_size`)
and what is wrong with it. P and D are checked against each other: KV blocks move
one to one between them, so whatever shapes a block must agree.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from pdcluster.proto.devices import DEVICES
from pdcluster.proto.router_spec import DEFAULT_MIGRATION_LIMIT, AdmissionSpec, HttpLimits, LocalPrefillSpec, Policy


class SpecError(ValueError):
    """An invalid cluster spec; the message names the field and the problem."""


class _Strict(BaseModel):
    # Unknown fields are errors: a typo ("block_sise") must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModelSpec(_Strict):
    """Generate a tiny random-weight model at `model.path` if it is missing."""

    arch: Literal["qwen3", "llama", "gemma3", "gptoss", "dsv4"] = "qwen3"
    seed: int = 0


class ModelSpec(_Strict):
    path: str = Field(description="checkpoint directory (config, weights, tokenizer)")
    name: str | None = Field(None, description="served model name; default: the directory name")
    tiny: TinyModelSpec | None = None

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).name


EngineKind = Literal["vllm", "sim"]


class EngineSpec(_Strict):
    """vLLM engine args. In a role's `engine:`, unset fields inherit the shared ones.

    `kind: sim` (or just `engine: sim`) runs the simulated engine (cluster/sim/):
    the same actors, router and transfer, with model execution replaced by the
    cost model named in the spec's `sim:` section. block_size, max_model_len,
    max_num_batched_tokens and max_num_seqs mean the same to it as to vLLM.
    """

    kind: EngineKind | None = None
    block_size: int | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    kv_cache_space_gib: int | None = Field(None, ge=1, description="KV pool per instance on CPU, whole GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_prefix_caching: bool | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    enforce_eager: bool | None = None
    seed: int | None = None
    extra: dict[str, Any] = Field(default_factory=dict, description="more AsyncEngineArgs, passed as is")

    def merged_over(self, base: EngineSpec) -> EngineSpec:
        # An explicit `null` inherits like an unset field (else None reaches the checks below).
        mine = self.model_dump(exclude_unset=True, exclude_none=True)
        merged = base.model_dump()
        merged.update({k: v for k, v in mine.items() if k != "extra"})
        merged["extra"] = {**base.extra, **self.extra}
        return EngineSpec(**merged)


# Every plane between the cluster's processes proves the secret (transfer/auth.py): this long at least.
MIN_SECRET_CHARS = 16

DEFAULT_ENGINE = EngineSpec(
    kind="vllm", block_size=128, max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=64,
    kv_cache_space_gib=1, enable_prefix_caching=True, dtype="auto", enforce_eager=True,
)


class ResourceSpec(_Strict):
    cpus: float = Field(0, ge=0, description="Ray num_cpus per instance")
    gpus: int = Field(0, ge=0)
    npus: int = Field(0, ge=0)
    cpu_bind: list[str] | None = Field(
        None, description="per instance, the cores its engine's threads use (CPU: VLLM_CPU_OMP_THREADS_BIND)")


class PlacementSpec(_Strict):
    """Which Ray nodes a role's instances go to, by node labels (`ray start --labels k=v`;
    the multi-host lab labels its hosts `pdc-host=hostK`). Labels, not node ids: an instance
    whose host died comes back on a node with the same labels when one rejoins."""

    labels: dict[str, str] = Field(default_factory=dict, description="every instance on a node with these labels")
    per_instance: list[dict[str, str]] | None = Field(
        None, description="instance i also on a node with per_instance[i]'s labels (e.g. its own host)")
    spread: bool = Field(False, description="spread the instances over the matching nodes (Ray's SPREAD)")

    @field_validator("labels", "per_instance")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        from ray._private.label_utils import validate_label_selector_value

        for labels in ([value] if isinstance(value, dict) else value or []):
            for k, v in labels.items():
                if not k or not v:
                    raise ValueError(f"label {k!r}: {v!r}: keys and values must be non-empty")
                if error := validate_label_selector_value(v):  # as Ray would say at the actor's start
                    raise ValueError(f"label {k!r}: {error}")
                # Ray 2.60 accepts `in(a, b)` but keeps the space: " b" then matches no node.
                labels[k] = re.sub(r",\s+", ",", v)
        return value

    def labels_of(self, index: int) -> dict[str, str]:
        """The node labels instance `index` needs."""
        return {**self.labels, **(self.per_instance[index] if self.per_instance else {})}


class RoleSpec(_Strict):
    instances: int = Field(1, ge=1, le=64)
    engine: EngineSpec = EngineSpec()
    resources: ResourceSpec = ResourceSpec()
    placement: PlacementSpec = PlacementSpec()

    @model_validator(mode="after")
    def _one_placement_per_instance(self) -> RoleSpec:
        per = self.placement.per_instance
        if per is not None and len(per) != self.instances:
            raise ValueError(f"placement.per_instance has {len(per)} entries for {self.instances} instances: "
                             f"give one per instance")
        return self


class TransferSpec(_Strict):
    # pdc: the project's connector (per-group plans, leases, timelines); nixl: vLLM's own
    # NixlConnector (needs the `nixl` packages), to compare the two on the same cluster.
    connector: Literal["pdc", "nixl"] = "pdc"
    # push: the router sends D its request with P's, and P streams each layer's KV
    # while its forward pass runs; pull: D asks for the KV after P finished (the
    # fallback, and the only mode of the nixl connector). Default: push for pdc.
    mode: Literal["push", "pull"] = "push"
    # grpc: the KV bytes inside the gRPC stream; torch_dist: gRPC only announces each
    # chunk, the bytes go over a torch.distributed pair channel (gloo on cpu, nccl on
    # cuda, hccl on npu: proto/devices.py).
    backend: Literal["grpc", "torch_dist"] = "grpc"
    base_port: int = Field(18600, ge=1024, le=65000, description="P instance i serves KV on base_port + i")
    lease_s: float = Field(60.0, gt=0, description="P frees a request's blocks if D has not acknowledged by then")
    timeout_s: float = Field(30.0, gt=0, description="D gives up receiving a request's KV after this long "
                                                      "(in push mode this includes P's queue and prefill)")
    # 1 MiB measured best on loopback (bench/grpc_bandwidth.py): P copies the next
    # chunk while D writes the last one.
    chunk_bytes: int = Field(1 << 20, ge=4096, description="gRPC message payload size")
    on_failure: Literal["error", "recompute"] = Field(
        "error", description="a failed transfer ends the request with an error, or D recomputes the prompt")
    # Fault injection, for tests: P breaks every transfer whose id starts with this
    # prefix halfway through its blocks, as a lost connection would.
    break_transfers_with_prefix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and "host" in data:
            raise ValueError("`host` is gone: every plane binds its own node's address; see `network:` "
                             "(mode, interface, cidr, bind_all)")
        if isinstance(data, dict) and data.get("mode") is None and data.get("connector", "pdc") != "pdc":
            data = {**data, "mode": "pull"}
        return data

    @model_validator(mode="after")
    def _check_mode(self) -> TransferSpec:
        if self.mode == "push" and self.connector != "pdc":
            raise ValueError(f"mode: push needs connector pdc; vLLM's {self.connector} connector only pulls")
        if self.backend != "grpc" and self.connector != "pdc":
            raise ValueError(f"backend: {self.backend} needs connector pdc; vLLM's {self.connector} connector "
                             f"brings its own transport")
        return self


class SimSpec(_Strict):
    """The simulated engine's settings (used when `engine: sim`)."""

    # A shipped parameter file by name (cluster/sim/params/<name>.yaml), or a path.
    params: str = Field(description="cost-model parameter file: a shipped name or a path to a YAML file")
    # Bytes that really move P -> D = modelled bytes / payload_scale, so 128K-token
    # requests fit in this machine's memory; the modelled transfer time uses the full size.
    payload_scale: int = Field(1024, ge=1, description="modelled state bytes per byte moved")
    kv_blocks: int | None = Field(None, gt=0, description="KV blocks per instance; default: the params file's")


class NetworkSpec(_Strict):
    """The address every instance's planes bind and advertise (transfer/network.py)."""

    # auto: loopback when the Ray cluster has one node at `pdc up`, else the node's address.
    mode: Literal["auto", "loopback", "node"] = "auto"
    interface: str | None = Field(None, description="node mode: this interface's IPv4 address on each node")
    cidr: str | None = Field(None, description="node mode: each node's address inside this network")
    bind_all: bool = Field(False, description="bind 0.0.0.0 (every interface), advertising the chosen address")

    @field_validator("cidr")
    @classmethod
    def _network(cls, cidr: str | None) -> str | None:
        import ipaddress

        if cidr is not None:
            try:
                ipaddress.IPv4Network(cidr, strict=False)
            except ValueError as err:
                raise ValueError(f"{cidr!r} is not an IPv4 network (e.g. 10.0.0.0/16): {err}") from None
        return cidr

    @model_validator(mode="after")
    def _consistent(self) -> NetworkSpec:
        if self.interface and self.cidr:
            raise ValueError("interface and cidr both set: name one way to pick each node's address")
        if self.mode == "loopback" and (self.interface or self.cidr or self.bind_all):
            raise ValueError("mode loopback binds 127.0.0.1: interface, cidr and bind_all need mode node (or auto)")
        return self


class AuthSpec(_Strict):
    """Secrets (shown masked in dumps, logs and run metadata)."""

    # Every plane between the cluster's processes proves it (transfer/auth.py). Unset: the env
    # var PDC_CLUSTER_SECRET, else `pdc up` generates one for this cluster's life.
    secret: SecretStr | None = None
    # The router's HTTP API answers 401 without `Authorization: Bearer <one of these>`
    # (/health stays open). Also from PDC_API_KEYS (comma-separated). None: open.
    api_keys: list[SecretStr] = Field(default_factory=list)

    @field_validator("secret")
    @classmethod
    def _long_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_CHARS:
            raise ValueError(f"must have at least {MIN_SECRET_CHARS} characters")
        return secret

    @field_validator("api_keys")
    @classmethod
    def _keys_non_empty(cls, keys: list[SecretStr]) -> list[SecretStr]:
        if any(not k.get_secret_value() for k in keys):
            raise ValueError("an API key is empty")
        return keys


class RouterSpec(_Strict):
    # The HTTP API's address: loopback unless the spec names another (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # How the router picks P and D (router/policies.py). prefix_aware reads every
    # instance's KV cache events (vLLM's kv_events_config over ZMQ).
    policy: Policy = "round_robin"
    kv_events_port: int = Field(18700, ge=1024, le=65000,
                                description="instance i (P first, then D) publishes KV events on kv_events_port + "
                                            "2i and answers replay requests on kv_events_port + 2i + 1")
    request_timeout_s: float = Field(300.0, gt=0, description="a request still unfinished after this gets an error")
    # What one client may cost (router/http_app.py HttpLimits, whose defaults these are).
    max_body_bytes: int = Field(HttpLimits.max_body_bytes, ge=1024, description="a request body over this many bytes gets a 413")
    body_timeout_s: float = Field(HttpLimits.body_timeout_s, gt=0, description="a request body not complete this long after its "
                                                          "headers gets a 408")
    client_stall_s: float = Field(HttpLimits.stall_s, gt=0, description="a streaming client that takes nothing for this long "
                                                          "has its request ended, as if it had gone")
    # router/pending_blocks.py: a prefix being prefilled counts as held where it was routed,
    # so the requests of a new family arriving meanwhile go behind it and hit.
    track_pending: bool = Field(True, description="count the blocks of routed requests as held before their KV "
                                                  "events confirm them")
    # router/local_prefill.py: D prefills a request itself when what its cache lacks is short.
    local_prefill: LocalPrefillSpec = LocalPrefillSpec()
    # router/admission.py: past these bounds a request gets a 429 at once, not a timeout.
    admission: AdmissionSpec = AdmissionSpec()
    # How often D sends a stream's new tokens, as vLLM's --stream-interval (tokens; 1: every
    # step); coalescing by time trades ITL for router CPU (bench/README.md "Streaming").
    stream_interval: int = Field(1, ge=1, description="D sends a request's new tokens once it has this many "
                                                      "(the first and the last at once), as vLLM's --stream-interval")
    stream_coalesce_ms: float = Field(0.0, ge=0, description="and at most once per this many ms (0: no time bound)")
    migration_limit: int = Field(DEFAULT_MIGRATION_LIMIT, ge=0, description="times a request may be moved off an "
                                 "instance lost under it (router/migration.py); 0: never")
    record_timeline: bool = Field(True, description="write every request's timeline to a run directory")
    runs_dir: str = Field(".pdcluster/runs", description="where run directories go (one per cluster start)")
    # One router process serves ~2,500-3,500 short requests/s here (bench/README.md); more
    # processes share host:port, as vLLM's --api-server-count (router/server.py).
    processes: int = Field(1, ge=1, le=64, description="router processes sharing host:port (SO_REUSEPORT), "
                                                       "each a Ray actor on the first one's node")
    labels: dict[str, str] | None = Field(
        None, description="put the routers on a Ray node with these labels; default: the node `pdc up` runs on")


class ClusterSpec(_Strict):
    name: str = "pdcluster"
    model: ModelSpec
    device: Literal["cpu", "cuda", "npu"] = "cpu"
    ray_address: str | None = Field(None, description="join this Ray cluster; default: start a local one")
    engine: EngineSpec = DEFAULT_ENGINE
    sim: SimSpec | None = None
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    transfer: TransferSpec = TransferSpec()
    router: RouterSpec = RouterSpec()
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
