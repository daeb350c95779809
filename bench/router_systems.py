"""The systems router_overhead.py measures: pdcluster's router in front of instant engine
actors, vllm-router and vLLM's toy proxy in front of fake HTTP backends, and the
calls-alone floors (no HTTP)."""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.bench.wrk_load import MAX_TOKENS, LoadResult, Spawned, free_port, wait_http

if TYPE_CHECKING:
    from pdcluster.proto.spec import ClusterSpec

FLOORS = {"ray": "Ray calls alone (no HTTP)", "ray_one_reply": "Ray calls alone, D in one reply",
          "channel": "request channel alone (no HTTP)"}


# ---- the systems -------------------------------------------------------------------------------

@dataclass
class System:
    """One proxy under test: its URL, what to switch before a run, whose CPU to count."""

    name: str
    url: str
    proxy_pids: list[int]
    backend_pids: list[int]
    prepare: Callable[[], None] | None = None  # run before each measurement (pdcluster's switches)

    def before_run(self) -> None:
        if self.prepare is not None:
            self.prepare()


def start_fake_backends(spawned: Spawned) -> tuple[str, str, list[int]]:
    """Fake P and D (bench/fake_pd_backend.py), each its own process; their URLs and pids."""
    urls, pids = [], []
    for name in ("fake-p", "fake-d"):
        port = free_port()
        proc = spawned.start(name, [sys.executable, "-m", "pdcluster.bench.fake_pd_backend", "--port", str(port),
                                    "--name", name])
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", 30, proc)
        urls.append(url)
        pids.append(proc.pid)
    return urls[0], urls[1], pids


def start_vllm_router(spawned: Spawned, binary: str, policy: str, p_url: str, d_url: str,
                      backend_pids: list[int]) -> System:
    port = free_port()
    proc = spawned.start(f"vllm-router-{policy}", [
        binary, "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url, "--policy", policy,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        # Its Prometheus exporter has a fixed default port: two routers would collide.
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())])
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", 60, proc)
    return System(f"vllm-router {policy}", url, [proc.pid], backend_pids)


def start_toy_proxy(spawned: Spawned, script: str, p_url: str, d_url: str, backend_pids: list[int]) -> System:
    port = free_port()
    p_port, d_port = p_url.rsplit(":", 1)[1], d_url.rsplit(":", 1)[1]
    proc = spawned.start("toy-proxy", [
        sys.executable, script, "--host", "127.0.0.1", "--port", str(port), "--prefiller-hosts", "127.0.0.1",
        "--prefiller-ports", p_port, "--decoder-hosts", "127.0.0.1", "--decoder-ports", d_port])
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthcheck", 60, proc)
    return System("vLLM toy proxy", url, [proc.pid], backend_pids)


@dataclass(frozen=True)
class PdcVariant:
    recording: bool
    policy: str | None  # None: the router as it is (no set_policy on it)
    tokens_per_delta: int = 1  # D's tokens per DecodeDelta (1: one per token, as vLLM steps)

    @property
    def name(self) -> str:
        batched = f", D {self.tokens_per_delta} tokens/delta" if self.tokens_per_delta > 1 else ""
        return f"pdcluster {self.policy or 'default'} rec {'on' if self.recording else 'off'}{batched}"


def pdc_variants(policies: Sequence[str], batched_tokens: int = MAX_TOKENS) -> list[PdcVariant]:
    """Recording on and off with the first policy; the other policies with recording on; then
    the first policy with D sending all its tokens in one delta (as a batching engine would)."""
    first = policies[0] if policies else None
    return [PdcVariant(True, first), PdcVariant(False, first), *(PdcVariant(True, p) for p in policies[1:]),
            PdcVariant(True, first, batched_tokens)]


def _bench_router_class():
    """The real RouterActor, plus what the benchmark asks of it (its pid, whether it switches policy)."""
    from pdcluster.router.server import RouterActor

    class BenchRouterActor(RouterActor):
        def pid(self) -> int:
            return os.getpid()

        def has_policies(self) -> bool:
            return hasattr(self, "set_policy")

    return BenchRouterActor


@dataclass
class PdCluster:
    url: str
    routers: list  # the routers' Ray actor handles: one, or several sharing the URL's port
    router_pids: list[int]
    engine_pids: list[int]
    engines: list = field(default_factory=list)  # P, D actor handles
    has_policies: bool = False
    secret: str = ""  # the cluster secret (its request channels ask for it)

    @property
    def router(self):
        return self.routers[0]

    def each_router(self, method: str, *args) -> list:
        """A router method on every router (as cluster/launch.py's Cluster.each_router)."""
        import ray

        return ray.get([getattr(r, method).remote(*args) for r in self.routers])


def bench_spec(model_dir: str, router_port: int, runs_dir: str, routers: int = 1) -> ClusterSpec:
    from pdcluster.proto.spec import parse_spec

    return parse_spec({
        "name": f"bench-router-overhead-{routers}",
        "model": {"path": model_dir, "tiny": {"arch": "qwen3"}},
        # pull: P's answer (no handle) then D, as the HTTP proxies do; push would need P's KV address.
        "transfer": {"mode": "pull", "base_port": free_port_block()},
        "router": {"host": "127.0.0.1", "port": router_port, "runs_dir": runs_dir,
                   "kv_events_port": free_port_block(), "processes": routers},
    })


def free_port_block() -> int:
    """A port in 20000..60000 whose next few are likely free too (KV and event ports count up from it)."""
    import random

    for _ in range(50):
        base = random.randrange(20000, 60000, 16)
        ok = True
        for port in range(base, base + 8):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free block of 8 ports in 20000..60000")


def start_pdcluster(model_dir: str, runs_dir: str, routers: int = 1) -> PdCluster:
    """One instant P and D, and `routers` router processes on one port (router.processes)."""
    import ray

    from pdcluster.bench.instant_engine import InstantEngine
    from pdcluster.cluster.launch import ensure_model, make_routers, settle_spec, start_routers
    from pdcluster.cluster.placement import alive_nodes
    from pdcluster.router.pd_dispatch import Instance

    spec = settle_spec(bench_spec(model_dir, free_port(), runs_dir, routers), alive_nodes())
    ensure_model(spec)
    engine_cls = ray.remote(InstantEngine)
    handles = {f"{role}-0": engine_cls.options(num_cpus=0, max_concurrency=1000).remote(spec, role, 0)
               for role in ("prefill", "decode")}
    infos = ray.get([h.info.remote() for h in handles.values()])
    insts = {i.name: Instance.of(i, handles[i.name]) for i in infos}
    actors = make_routers(spec, detached=False, started=[], body=_bench_router_class())
    url, _ = start_routers(spec, actors, [insts["prefill-0"]], [insts["decode-0"]], infos)
    return PdCluster(url, actors, ray.get([a.pid.remote() for a in actors]), [i.pid for i in infos],
                     [handles["prefill-0"], handles["decode-0"]], ray.get(actors[0].has_policies.remote()),
                     spec.secret())


def pdc_system(cluster: PdCluster, variant: PdcVariant) -> System:
    import ray

    def prepare() -> None:
        cluster.each_router("set_recording", variant.recording)
        ray.get(cluster.engines[1].set_tokens_per_delta.remote(variant.tokens_per_delta))
        if variant.policy is not None:
            cluster.each_router("set_policy", variant.policy)

    name = variant.name if len(cluster.routers) == 1 else f"{variant.name}, {len(cluster.routers)} routers"
    return System(name, cluster.url, cluster.router_pids, cluster.engine_pids, prepare)


class CallsAlone:
    """Ray actor body: the calls one request makes of the engines (P's prefill, then D's
    decode read item by item), with no HTTP, tokenizer or records: the floor of a router
    that reaches its engines that way. Paths (FLOORS): Ray actor calls, as the router
    made them before issue 6; Ray with D's deltas in one reply; the request channel
    (transfer/request_channel.py), as the router makes them now."""

    def __init__(self, prefill, decode, secret: str):
        self.prefill, self.decode, self.secret = prefill, decode, secret
        self.channels = None

    def pid(self) -> int:
        return os.getpid()

    async def run(self, concurrency: int, duration_s: float, max_tokens: int, path: str = "ray") -> list[float]:
        """Closed loop for `duration_s`; each request's latency in seconds."""
        import asyncio

        from pdcluster.proto.messages import DecodeRequest, PrefillRequest, SamplingSpec
        from pdcluster.transfer.request_channel import EngineChannel

        assert path in FLOORS, f"unknown path {path!r}"
        if path == "channel" and self.channels is None:
            self.channels = [await EngineChannel(n, a, self.secret).connect()
                             for n, a in (("prefill-0", self.prefill), ("decode-0", self.decode))]
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompt = list(range(3, 15))
        latencies: list[float] = []
        end = time.monotonic() + duration_s

        async def one(rid: str) -> None:
            if path == "channel":
                p, d = self.channels
                await p.call("prefill", PrefillRequest(rid, prompt, sampling)).next()
                call = d.call("decode", DecodeRequest(rid, prompt, sampling, None))  # no KV: an instant engine
                while not call.done:
                    await call.next()
                return
            await self.prefill.prefill.remote(PrefillRequest(rid, prompt, sampling))
            req = DecodeRequest(rid, prompt, sampling, None)
            if path == "ray_one_reply":
                await self.decode.decode_in_one_reply.remote(req)
            else:
                async for ref in self.decode.decode.options(num_returns="streaming").remote(req):
                    await ref

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < end:
                t0 = time.monotonic()
                await one(f"floor-{w}-{n}")
                latencies.append(time.monotonic() - t0)
                n += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return latencies


def ray_floor_result(latencies: Sequence[float], duration_s: float, cpu_s: float) -> LoadResult:
    """CallsAlone's latencies as a LoadResult (its CPU as the 'client' CPU: it is the caller)."""
    lat = sorted(latencies)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")  # noqa: E731
    return LoadResult(len(lat), duration_s, pct(0.5), pct(0.9), pct(0.99),
                      statistics.fmean(lat) * 1e3 if lat else float("nan"), 0, 0, cpu_s)


