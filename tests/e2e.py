"""Helpers for end-to-end tests on real engines: specs, a reference engine, HTTP calls."""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdcluster.cluster.ports import free_port_run  # noqa: F401  (the e2e modules import it from here)
from pdcluster.proto.spec import ClusterSpec, parse_spec

MODEL_CACHE = Path(os.environ.get("PDC_TEST_MODEL_DIR", Path(__file__).resolve().parent.parent / ".pdcluster" / "models"))


def tiny_model_dir() -> str:
    """The seed-0 tiny Qwen3, made once per checkout (deterministic, so reuse is safe)."""
    from pdcluster.cluster.tiny_model import cached_tiny_model

    return str(cached_tiny_model(MODEL_CACHE / "tiny-qwen3"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settled(spec: ClusterSpec) -> ClusterSpec:
    """`spec` as build_cluster hands it to actors on one node (a fresh secret, loopback): for
    tests that make engine bodies themselves."""
    from pdcluster.cluster.launch import settle_spec
    from pdcluster.cluster.placement import NodeView

    return settle_spec(spec, [NodeView("node-0", "127.0.0.1", {})], environ={})


def cluster_spec_for(name: str, prefill: int = 1, decode: int = 1, prefill_engine: dict | None = None,
                     **overrides) -> ClusterSpec:
    """A tiny CPU cluster on free ports; `overrides` are merged into the top level, and
    `prefill_engine` is P's `prefill.engine`."""
    # Every fixed port from one run found free now (KV ports, then two KV-event ports per
    # instance, then the router's): modules that follow each other never share a port with
    # the previous cluster's engine processes, which may still be exiting.
    n = prefill + decode
    ports = free_port_run(3 * n + 1)
    data = {
        "name": name,
        "model": {"path": tiny_model_dir(), "name": "tiny-qwen3"},
        "engine": {"block_size": 128, "max_model_len": 8192, "max_num_batched_tokens": 8192,
                   "kv_cache_space_gib": 1, "dtype": "float32"},
        "prefill": {"instances": prefill, "resources": {"cpu_bind": ["0"] * prefill}, "engine": prefill_engine or {}},
        "decode": {"instances": decode, "resources": {"cpu_bind": ["1"] * decode}},
        "transfer": {"base_port": ports, "timeout_s": 20, "lease_s": 60,
                     "break_transfers_with_prefix": FAULT_PREFIX},
        "router": {"port": ports + 3 * n, "request_timeout_s": 60, "kv_events_port": ports + n},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_spec(data)


# The model's output parsers on the shared "p1d1", as test_e2e_vllm_serve starts vllm serve with them:
# hermes' tool calls, and deepseek_v3's reasoning (apart only when the template thinks, so plain chat
# answers stay content).
PARSERS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "deepseek_v3"}


def p1d1_spec() -> ClusterSpec:
    """The shared "p1d1" every module marked shared_cluster("p1d1") asks for (the first starts it)."""
    return cluster_spec_for("e2e-p1d1", model=PARSERS)


P1_BLOCKS = 70  # P's and D's device KV pool in p1d1-bf16, vLLM's null block included: 69 usable blocks of 128 tokens
P1_TIER_GIB = 0.05  # and their host tiers: 400 blocks of the tiny bf16 model (128 KiB each)


def p1d1_bf16_spec() -> ClusterSpec:
    """The P1D1 that test_e2e_local_prefill and test_e2e_recompute share (shared_cluster
    "p1d1-bf16"): bfloat16 as the users' engines run, D prefills short remainders itself
    (router.local_prefill, max_tokens 256, prefix_aware routing), and a failed transfer makes D
    prefill instead (transfer.on_failure recompute) with a short lease, since a broken pull never
    releases P's blocks: the lease outlives D's wait for a P that accepts no connection
    (grpc_client.CONNECT_S, 5 s). P and D each have a host KV tier beside a small device pool
    (P1_BLOCKS blocks, just over one max_model_len prompt), which test_e2e_tier evicts prompts from."""
    return cluster_spec_for("e2e-p1d1-bf16", engine={"dtype": "bfloat16", "host_tier_gib": P1_TIER_GIB,
                                                     "extra": {"num_gpu_blocks_override": P1_BLOCKS}},
                            transfer={"on_failure": "recompute", "lease_s": 9},
                            router={"policy": "prefix_aware",
                                    "local_prefill": {"policy": "short_remainder", "max_tokens": 256}})


# A P2D2 instance's KV pool there, vLLM's null block included: 11 usable, ~2 of
# test_e2e_kv_events's families and a running request.
P2D2_POOL_BLOCKS = 12


def p2d2_small_pool_spec() -> ClusterSpec:
    """The P2D2 that test_e2e_kv_events and test_e2e_migration share (shared_cluster "p2d2"):
    pools of P2D2_POOL_BLOCKS blocks, so prefix families evict each other, and round-robin routing
    (test_e2e_migration switches it to least_load)."""
    return cluster_spec_for("e2e-p2d2", 2, 2,
                            engine={"max_model_len": 1024, "max_num_batched_tokens": 1024,
                                    "extra": {"num_gpu_blocks_override": P2D2_POOL_BLOCKS}},
                            router={"policy": "round_robin"})


@contextmanager
def running_cluster(spec: ClusterSpec):
    """`spec`'s cluster for one module: on the session's local Ray (`local_ray`), or, for a spec
    with a ray_address (a lab's), as cluster.launch.running_cluster runs it, the local Ray
    stopped first (one driver joins one Ray)."""
    from pdcluster.cluster import launch

    if spec.ray_address:
        stop_local_ray()
        with launch.running_cluster(spec) as cluster:
            yield cluster
        return
    local_ray()
    cluster = launch.build_cluster(spec)
    try:
        yield cluster
    finally:
        launch.teardown(cluster)


def placed(spec: ClusterSpec, **labels: dict[str, str]) -> ClusterSpec:
    """`spec` with each named role's instances on Ray nodes with these labels (e.g. a lab's
    `prefill={"pdc-host": "host1"}`)."""
    from pdcluster.proto.spec import PlacementSpec

    return spec.model_copy(update={role: getattr(spec, role).model_copy(update={"placement": PlacementSpec(labels=want)})
                                   for role, want in labels.items()})


def health(cluster) -> dict[str, bool]:
    """Each instance's health as the router's /health reports it."""
    return httpx.get(f"{cluster.url}/health", timeout=10).json()["instances"]


def complete(url: str, prompt: list[int] | str, max_tokens: int = 16, timeout: float = 120,
             request_id: str | None = None, **extra) -> httpx.Response:
    body = {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    headers = {"X-Request-Id": request_id} if request_id else None
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, headers=headers)


# The e2e clusters' fault injection (transfer.break_transfers_with_prefix): a request
# sent with X-Request-Id "fault-..." loses its KV transfer halfway.
FAULT_PREFIX = "cmpl-fault-"


def assert_no_kv_in_use(cluster, timeout: float = 15):
    """Every instance's KV cache back to 0 blocks in use (leases ended, nothing leaked)."""
    import ray

    for inst in cluster.instances:
        wait_until(lambda: ray.get(inst.actor.load.remote()).kv_cache_usage == 0.0, timeout,
                   what=f"{inst.name} KV usage back to 0")


def wait_until(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s")


TRANSPORTS = ("grpc", "torch_dist")


def reset_caches(cluster, timeout: float = 30):
    """Empty every instance's prefix cache (retrying while a lease still pins blocks)."""
    import ray

    for inst in cluster.instances:
        wait_until(lambda: ray.get(inst.actor.reset_prefix_cache.remote()), timeout, what=f"{inst.name} cache reset")


@contextmanager
def transfer_as(cluster, mode: str | None = None, transport: str | None = None):
    """The router transfers in this mode (push | pull) over this transport (grpc | torch_dist)
    until the block ends, then goes back to the spec's; None keeps the spec's."""

    spec = cluster.spec.transfer
    cluster.each_router("set_transfer_mode", mode or spec.mode, transport or spec.backend)
    try:
        yield
    finally:
        cluster.each_router("set_transfer_mode", spec.mode, spec.backend)


@contextmanager
def local_prefill_as(cluster, **fields):
    """The routers decide local prefills by these router.local_prefill fields until the block
    ends, then go back to the spec's."""
    spec = cluster.spec.router.local_prefill
    cluster.each_router("set_local_prefill", spec.model_copy(update=fields).model_dump())
    try:
        yield
    finally:
        cluster.each_router("set_local_prefill", spec.model_dump())


def serve_over_each_transport(cluster, prompts: list[list[int]], wants: list[list[int]], max_tokens: int = 8,
                              timeout: float = 120) -> list[tuple[list[int], dict, list[int]]]:
    """(prompt, response body, reference tokens) for every prompt over each transport, from empty caches."""
    out = []
    for name in TRANSPORTS:
        reset_caches(cluster)
        with transfer_as(cluster, transport=name):
            for p, want in zip(prompts, wants):
                r = complete(cluster.url, p, max_tokens, timeout=timeout)
                assert r.status_code == 200, (name, r.text)
                out.append((p, r.json(), want))
    return out


def seed_prompts_000() -> tuple[list[int], list[int], list[int]]:
    """The first seed's prompts (../shared/seeds/000): A and B share a 1,024-token document and
    differ in a 14-token question; B' is B with token 17 changed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    doc = tok.encode("Prefix caching saves prefill computation, not memory. " * 200)[:1024]
    suffix_a = tok.encode(" Question A: briefly describe what the cache does.")[:14]
    suffix_b = tok.encode(" Question B: what computation can repeated input save?")[:14]
    assert len(doc) == 1024 and len(suffix_a) == len(suffix_b) == 14
    a, b = doc + suffix_a, doc + suffix_b
    b_changed = list(b)
    b_changed[17] = (b[17] + 1) % len(tok)
    return a, b, b_changed


class RunsCode:
    """Unpickled, writes `marker`: proof, for the security tests, that something unpickled it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled"))


def evil_pickle(marker) -> bytes:
    import pickle

    return pickle.dumps([RunsCode(marker)], protocol=5)


def run_with(run_dir: str, request_ids, timeout: float = 10.0):
    """The run with the records of `request_ids` only, once it holds every one: the router
    appends a request's record as the request ends, a moment after the client has its last
    byte (and a shared cluster's run holds other modules' requests too)."""
    from dataclasses import replace

    from pdcluster.router.run_store import load_run

    want = set(request_ids)

    def complete_run():
        run = load_run(run_dir)
        if not want <= {r.request_id for r in run.records}:
            return None
        return replace(run, records=[r for r in run.records if r.request_id in want])

    return wait_until(complete_run, timeout, interval=0.05, what=f"records of {len(want)} requests")


# ---------------------------------------------------------------- clusters e2e modules share

_SHARED: dict[str, tuple] = {}  # name -> (its running_cluster context, the cluster)


def shared_cluster(name: str, make_spec):
    """The cluster that the modules marked `pytest.mark.shared_cluster(name)` share: the first
    to ask starts it from `make_spec()`; each next one gets it with every instance healthy and
    every prefix cache empty. conftest.py runs those modules one after another and stops it
    after the last one's last test (`stop_shared_cluster`)."""
    if name not in _SHARED:
        context = running_cluster(make_spec())
        _SHARED[name] = (context, context.__enter__())
        return _SHARED[name][1]
    cluster = _SHARED[name][1]
    wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200, 180, interval=1,
               what=f"shared cluster {name} healthy")
    reset_caches(cluster)
    return cluster


def stop_shared_cluster(name: str) -> None:
    context, _ = _SHARED.pop(name, (None, None))
    if context is not None:
        context.__exit__(None, None, None)




# The labs that modules marked `pytest.mark.shared_lab(name)` share: name -> Lab.up's arguments.
# "lab4": four hosts; a host cut for less than 20 s keeps its Ray node (cluster/ray_settings.py).
LABS = {"lab4": {"hosts": 4, "name": "pdcl4", "subnet": "10.213.61.0/24", "partition_tolerance_s": 20.0}}
_SHARED_LABS: dict[str, object] = {}  # name -> the running Lab


def shared_lab(name: str):
    """The lab (cluster/lab.py) of LABS[name] that the modules marked `pytest.mark.shared_lab(name)`
    share: the first to ask makes it; conftest.py runs those modules one after another and takes it
    down after the last one's last test (`stop_shared_lab`). Each module leaves it as it found it:
    every host up, no cut, no shaping (checked here for the next)."""
    from pdcluster.cluster.lab import Lab

    if name not in _SHARED_LABS:
        _SHARED_LABS[name] = Lab.up(**LABS[name])
    lab = _SHARED_LABS[name]
    assert not lab.partitions, f"lab {name}: a cut was left in place: {lab.partitions}"
    return lab


def stop_shared_lab(name: str) -> None:
    lab = _SHARED_LABS.pop(name, None)
    if lab is not None:
        lab.down()


# ---------------------------------------------------------------- the session's local Ray

_REFERENCE: dict[str, object] = {}  # dtype -> the shared tiny-Qwen3 reference engine's actor, while the local Ray stands


def local_ray() -> None:
    """The local Ray that the modules marked `pytest.mark.local_ray` run on, one after another:
    started by the first that asks, stopped by conftest.py after the last (`stop_local_ray`), so
    that each module spends no Ray start and stop (~5 s here) and they can share engines."""
    import ray

    from pdcluster.cluster.launch import start_local_ray

    if not ray.is_initialized():
        start_local_ray()


def stop_local_ray() -> None:
    """Stop the local Ray if this process runs one (and whatever still runs on it)."""
    import ray

    assert not _SHARED, f"shared clusters still up: {sorted(_SHARED)}"
    _REFERENCE.clear()
    if ray.is_initialized():
        ray.shutdown()


def shared_reference(dtype: str = "float32"):
    """The single tiny-Qwen3 engine of `dtype` (cluster/reference_engine.py) that the local-Ray
    modules compare with, on core 0: started by the first that asks, gone with the local Ray."""
    import ray

    from pdcluster.cluster.reference_engine import GreedyReference

    local_ray()
    if dtype not in _REFERENCE:
        _REFERENCE[dtype] = ray.remote(num_cpus=0)(GreedyReference).remote(tiny_model_dir(), "0", dtype=dtype)
    return _REFERENCE[dtype]
