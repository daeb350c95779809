"""The cluster spec's sections, one model each: the model, an engine, a role, placement, the
transfer, the simulated engine, the network, the secret and keys, the router. proto/spec.py
puts them together as `ClusterSpec` and checks P and D against each other."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from pdcluster.proto.router_spec import DEFAULT_MIGRATION_LIMIT, AdmissionSpec, HttpLimits, LocalPrefillSpec, Policy


class SpecError(ValueError):
    """An invalid cluster spec; the message names the field and the problem."""


class _Strict(BaseModel):
    # Unknown fields are errors: a typo ("block_sise") must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyModelSpec(_Strict):
    """Generate a tiny random-weight model at `model.path` if it is missing."""

    arch: Literal["qwen3", "llama", "gemma3", "gptoss", "dsv4"] = "qwen3"  # the architecture (cluster/tiny_model.py)
    seed: int = 0  # its random weights' seed


class ModelSpec(_Strict):
    path: str = Field(description="checkpoint directory (config, weights, tokenizer)")
    name: str | None = Field(None, description="served model name; default: the directory name")
    tiny: TinyModelSpec | None = None
    # The model family's output formats, as vllm serve's flags of the same names: the router runs
    # vLLM's parsers of these names on D's answers (router/chat_parsers.py).
    tool_call_parser: str | None = Field(None, description="vLLM's tool parser for the model (--tool-call-parser: "
                                                            "hermes, qwen3_xml, deepseek_v4...)")
    enable_auto_tool_choice: bool = Field(False, description="parse the model's own tool calls (tool_choice auto, "
                                                             "as --enable-auto-tool-choice); needs tool_call_parser")
    reasoning_parser: str | None = Field(None, description="vLLM's reasoning parser for the model "
                                                           "(--reasoning-parser: qwen3, deepseek_r1...): the answer's "
                                                           "reasoning comes apart, as reasoning")

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> ModelSpec:
        if self.enable_auto_tool_choice and not self.tool_call_parser:  # vllm serve's own check
            raise ValueError("model.enable_auto_tool_choice needs model.tool_call_parser")
        return self

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

    kind: EngineKind | None = None  # vllm: real engines; sim: the simulated engine (the spec's sim: section)
    block_size: int | None = Field(None, gt=0, description="tokens per KV block; P's and D's must agree (blocks move "
                                                           "one to one)")
    max_model_len: int | None = Field(None, gt=0, description="the longest prompt + output an engine takes")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="tokens one engine step computes at most (the "
                                                                       "chunked-prefill budget)")
    max_num_seqs: int | None = Field(None, gt=0, description="requests an engine runs at once at most")
    kv_cache_space_gib: int | None = Field(None, ge=1, description="KV pool per instance on CPU, whole GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="GPU/NPU memory share vLLM takes")
    host_tier_gib: float | None = Field(
        None, ge=0, description="a host-memory KV tier per instance, GiB (0 or unset: none): prompt blocks the device "
                                "cache drops come back from it (docs/kv_tiers.md)")
    enable_prefix_caching: bool | None = None  # must be true: both sides skip what their prefix cache holds
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None  # weights and KV; P's and D's must agree
    enforce_eager: bool | None = None  # no CUDA/NPU graphs
    seed: int | None = None  # vLLM's sampling seed
    extra: dict[str, Any] = Field(default_factory=dict, description="more AsyncEngineArgs, passed as is")

    def merged_over(self, base: EngineSpec) -> EngineSpec:
        # An explicit `null` inherits like an unset field (else None reaches the checks below).
        mine = self.model_dump(exclude_unset=True, exclude_none=True)
        merged = base.model_dump()
        merged.update({k: v for k, v in mine.items() if k != "extra"})
        merged["extra"] = {**base.extra, **self.extra}
        return EngineSpec(**merged)


# Every plane between the cluster's processes proves the secret (transfer/auth.py), so one sniffed
# handshake lets anyone guess it offline: it must be out of guessing's reach.
MIN_SECRET_BITS = 128
MIN_SECRET_DISTINCT = 8  # different characters at least ("aaaa...": no length makes that random)
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"


def secret_weakness(secret: str) -> str | None:
    """Why `secret` is too weak for a cluster secret, or None. Its strength is estimated as a
    random string of its length over the character classes it uses (lower, upper, digits,
    others): generous to words and dates ("pdcluster-prod-2025" fell to 119 offline guesses,
    estimated 116 bits here), so the bar is the full 128 bits."""
    pool = sum(size for test, size in ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))
               if any(test(c) for c in secret)) + (33 if any(not c.isalnum() for c in secret) else 0)
    bits = len(secret) * math.log2(pool) if pool else 0.0
    if bits < MIN_SECRET_BITS or len(set(secret)) < MIN_SECRET_DISTINCT:
        return (f"too weak: a guessable secret opens every plane (about {bits:.0f} bits by its length and "
                f"characters, {len(set(secret))} different ones; {MIN_SECRET_BITS} bits and "
                f"{MIN_SECRET_DISTINCT} different characters needed): make one with `{MAKE_SECRET}`")
    return None

DEFAULT_ENGINE = EngineSpec(
    kind="vllm", block_size=128, max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=64,
    kv_cache_space_gib=1, enable_prefix_caching=True, dtype="auto", enforce_eager=True,
)


class ResourceSpec(_Strict):
    cpus: float = Field(0, ge=0, description="Ray num_cpus per instance")
    gpus: int = Field(0, ge=0, description="GPUs per instance (Ray's GPU resource); device cuda needs 1 or more")
    npus: int = Field(0, ge=0, description="NPUs per instance (Ray's NPU resource); device npu needs 1 or more")
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
    # 0 only for prefill with router.local_prefill.policy always (ClusterSpec checks it).
    instances: int = Field(1, ge=0, le=64)
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
    encrypt: bool = Field(False, description="seal the KV bytes on the gRPC stream with AES-GCM (transfer/kv_seal.py: "
                                             "a copy and the cipher's time a side; bench/README.md \"Sealed KV\")")
    on_failure: Literal["error", "recompute"] = Field(
        "error", description="a failed transfer ends the request with an error, or D recomputes the prompt")
    # Fault injection, for tests: the router gives the transfers of requests whose id starts
    # with this prefix an id with it in front, and P breaks each halfway through its blocks, as
    # a lost connection would; a host tier fails its loads for requests whose id starts with it.
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
        if self.encrypt and (self.backend != "grpc" or self.connector != "pdc"):
            raise ValueError("encrypt: true seals KV inside the project's gRPC streams; backend "
                             f"{self.backend} with connector {self.connector} would send it in clear")
        return self


class RoleKvBlocks(_Strict):
    """KV blocks per instance, each role its own (unset: the params file's)."""

    prefill: int | None = Field(None, gt=0, description="KV blocks per P instance")
    decode: int | None = Field(None, gt=0, description="KV blocks per D instance")


class SimSpec(_Strict):
    """The simulated engine's settings (used when `engine: sim`)."""

    # A shipped parameter file by name (cluster/sim/params/<name>.yaml), or a path.
    params: str = Field(description="cost-model parameter file: a shipped name or a path to a YAML file")
    # Bytes that really move P -> D = modelled bytes / payload_scale, so 128K-token
    # requests fit in this machine's memory; the modelled transfer time uses the full size.
    payload_scale: int = Field(1024, ge=1, description="modelled state bytes per byte moved")
    kv_blocks: Annotated[int, Field(gt=0)] | RoleKvBlocks | None = Field(
        None, description="KV blocks per instance, or per role ({prefill: N, decode: M}); default: what the "
                                "params file's device holds")
    devices_per_instance: int = Field(1, ge=1, description="devices one instance runs on (tensor parallel); "
                                                            "a degree the params file's parallel section prices")


    def kv_blocks_of(self, role: str) -> int | None:
        """The KV blocks `role`'s instances have; None: the params file's."""
        return getattr(self.kv_blocks, role) if isinstance(self.kv_blocks, RoleKvBlocks) else self.kv_blocks


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
    # With api_keys: /metrics open too (for a Prometheus scraping without a bearer token).
    open_metrics: bool = False

    @field_validator("secret")
    @classmethod
    def _strong_enough(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and (why := secret_weakness(secret.get_secret_value())):
            raise ValueError(why)
        return secret

    @field_validator("api_keys")
    @classmethod
    def _keys_non_empty(cls, keys: list[SecretStr]) -> list[SecretStr]:
        if any(not k.get_secret_value() for k in keys):
            raise ValueError("an API key is empty")
        return keys


class ObservabilitySpec(_Strict):
    """Where the router sends what it records, besides its run directory and /metrics."""

    otlp_endpoint: str | None = Field(None, description="an OTLP/HTTP traces endpoint (e.g. http://collector:4318/"
                                                        "v1/traces): each request's phases as spans (router/otlp.py)")
    service_name: str = Field("pdcluster", min_length=1, description="the spans' service.name")


class RouterSpec(_Strict):
    # The HTTP API's address (0.0.0.0: every interface). Unset: loopback, or, for routers that
    # router.labels put on another host, that host's address (loopback there answers no client).
    host: str | None = None
    port: int = Field(8000, ge=1, le=65535, description="the HTTP port (every router process shares it)")
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
    # router/http_protocol.py: what a connection may hold before it is a request.
    header_timeout_s: float = Field(10.0, gt=0, le=600, description="a connection whose request headers are not "
                                    "complete this long after it opened (or after its last response) is closed")
    max_connections: int = Field(4096, ge=1, description="HTTP connections a router process keeps open; one past "
                                 "it is closed at once (capped below the process's file limit)")
    # router/pending_blocks.py: a prefix being prefilled counts as held where it was routed,
    # so the requests of a new family arriving meanwhile go behind it and hit.
    track_pending: bool = Field(True, description="count the blocks of routed requests as held before their KV "
                                                  "events confirm them")
    # router/local_prefill.py: D prefills a request itself when what its cache lacks is short.
    local_prefill: LocalPrefillSpec = LocalPrefillSpec()
    # router/routing.py: the pool for P (docs/kv_tiers.md "The pool"); off until its figures say more.
    p_pool: bool = Field(False, description="a P reads the prompt's first blocks from a peer P's host KV tier "
                                            "when that peer holds a longer run and reading it is predicted "
                                            "cheaper than computing it")
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
    # router/run_store.py:FilePolicy. C90's 6 req/s of 1K-token answers write ~3.2 GB a day
    # (bench/README.md "Run files"): the defaults keep at most 17 x 256 MiB a router process.
    record_file_mb: int = Field(256, ge=1, description="a router's request file rotates past this many MB")
    record_files_kept: int | None = Field(16, ge=1, description="rotated files kept per router process, the "
                                          "oldest deleted past it; null: all")
    record_fsync_s: float | None = Field(1.0, gt=0, le=3600, description="records reach the device within this "
                                         "many seconds (a power loss loses at most that); null: at stop only")
    # One router process serves ~2,500-3,500 short requests/s here (bench/README.md); more
    # processes share host:port, as vLLM's --api-server-count (router/server.py).
    processes: int = Field(1, ge=1, le=64, description="router processes sharing host:port (SO_REUSEPORT), "
                                                       "each a Ray actor on the first one's node")
    labels: dict[str, str] | None = Field(
        None, description="put the routers on a Ray node with these labels; default: the node `pdc up` runs on")

    def bind_host(self, node_ip: str) -> str:
        """The address the routers listen on, on a node whose Ray address is `node_ip`."""
        if self.host is not None:
            return self.host
        return node_ip if self.labels else "127.0.0.1"
