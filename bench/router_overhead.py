"""The router's own overhead, side by side with vllm-router and vLLM's toy P/D proxy (issue 6).

Every system sits in front of backends that answer at once, so what is
measured is the proxy: requests per second at concurrency 32, and p50 latency
at concurrency 1, for short prompts and a few output tokens, non-streaming and
streaming. All systems are measured in one run, settings interleaved (each
setting runs every system in turn), since this 2-core machine is shared.

- pdcluster: the real `RouterActor` (uvicorn and its own ASGI app in a Ray actor) in front
  of P and D `InstantEngine` actors (bench/instant_engine.py): its backends are Ray
  actors reached over their request channels (TCP), not HTTP servers. Variants: timeline recording on/off
  (`set_recording`), and each routing policy if the router has `set_policy`. `--routers 1,2`:
  a cluster each with 1 and with 2 router processes sharing one port (`router.processes`,
  SO_REUSEPORT, as vLLM's `--api-server-count`).
- vllm-router (`--vllm-pd-disaggregation --prefill URL --decode URL`), with
  round_robin and cache_aware, and vLLM's toy P/D proxy
  (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), in front of
  two `fake_pd_backend` processes (P and D, instant, answering the
  `kv_transfer_params` hand-off both proxies make).

The load generator is wrk (C, keep-alive, one thread), a separate process;
its CPU share is reported so a saturated client shows. Also reported per
system: CPU microseconds per request of the proxy process(es) and of its
backends (psutil), the fairest figure on a shared machine.

usage: python -m pdcluster.bench.router_overhead [--duration 8] [--rounds 1]
       [--vllm-router /work/.venvs/vllm-router/bin/vllm-router]
       [--toy-proxy /path/to/toy_proxy_server.py] [--only pdcluster,vllm] [--routers 1,2] [--profile]
wrk: `apt-get install wrk`; vllm-router: `pip install vllm-router` into a venv of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.cluster.spec import ClusterSpec

PROMPT = "Hello there, this is a short prompt for measuring a router."
MAX_TOKENS = 4
DEFAULT_VLLM_ROUTER = "/work/.venvs/vllm-router/bin/vllm-router"
DEFAULT_TOY_PROXY = "/work/.venvs/toy_proxy/toy_proxy_server.py"


# ---- the load: wrk, a request body, its result -------------------------------------------------

def request_body(model: str, stream: bool, max_tokens: int = MAX_TOKENS, prompt: str = PROMPT) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def wrk_script(body: dict) -> str:
    """wrk's Lua: POST `body`; at the end one JSON line with the counts and latency percentiles."""
    lua_body = json.dumps(json.dumps(body))  # a Lua string literal: JSON's escaping is valid Lua
    return f"""wrk.method = "POST"
wrk.body = {lua_body}
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{{"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "mean_us": %.1f, '
    .. '"errors": %d, "non_2xx": %d}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, e.connect + e.read + e.write + e.timeout, e.status))
end
"""


@dataclass(frozen=True)
class LoadResult:
    requests: int
    duration_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    errors: int  # connect, read, write, timeout
    non_2xx: int
    client_cpu_s: float = 0.0  # wrk's own user + system time

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def client_cpu_share(self) -> float:
        """wrk's CPU over wall time: near 1.0 would mean the client, not the proxy, limits."""
        return self.client_cpu_s / self.duration_s if self.duration_s else 0.0


def parse_wrk(stdout: str, client_cpu_s: float = 0.0) -> LoadResult:
    """The JSON line our `done` writes, wherever it is in wrk's output."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{") and '"requests"' in line:
            d = json.loads(line)
            return LoadResult(d["requests"], d["duration_us"] / 1e6, d["p50_us"] / 1e3, d["p90_us"] / 1e3,
                              d["p99_us"] / 1e3, d["mean_us"] / 1e3, d["errors"], d["non_2xx"], client_cpu_s)
    raise ValueError(f"no result line in wrk's output (did the Lua script run?):\n{stdout[-2000:]}")


def run_wrk(url: str, script: Path, connections: int, duration_s: float) -> LoadResult:
    """One wrk run (one thread, keep-alive); its CPU from wait4 (the child's own rusage)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "10s",
                                 "-s", str(script), url], stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}:\n{text[-2000:]}")
    return parse_wrk(text, usage.ru_utime + usage.ru_stime)


# ---- processes and their CPU -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU of these processes and their children so far (vanished ones count 0)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = q.cpu_times()
                total += t.user + t.system
    return total


def wait_http(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before serving {url}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing answered at {url} within {timeout_s:.0f} s")


@dataclass
class Spawned:
    """Processes this benchmark started: each is ended by its own pid at the end."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="router-overhead-")))

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115  (open for the process's lifetime)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


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

    @property
    def router(self):
        return self.routers[0]

    def each_router(self, method: str, *args) -> list:
        """A router method on every router (as cluster/launch.py's Cluster.each_router)."""
        import ray

        return ray.get([getattr(r, method).remote(*args) for r in self.routers])


def bench_spec(model_dir: str, router_port: int, runs_dir: str, routers: int = 1) -> ClusterSpec:
    from pdcluster.cluster.spec import parse_spec

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
    from pdcluster.cluster.launch import ensure_model, start_routers
    from pdcluster.router.pd_dispatch import Instance

    spec = bench_spec(model_dir, free_port(), runs_dir, routers)
    ensure_model(spec)
    engine_cls = ray.remote(InstantEngine)
    handles = {f"{role}-0": engine_cls.options(num_cpus=0, max_concurrency=1000).remote(spec, role, 0)
               for role in ("prefill", "decode")}
    infos = ray.get([h.info.remote() for h in handles.values()])
    insts = {i.name: Instance(i.name, handles[i.name], i.engine_id, i.kv_address) for i in infos}
    actors, url, _ = start_routers(spec, [insts["prefill-0"]], [insts["decode-0"]], infos, detached=False,
                                   started=[], body=_bench_router_class())
    return PdCluster(url, actors, ray.get([a.pid.remote() for a in actors]), [i.pid for i in infos],
                     [handles["prefill-0"], handles["decode-0"]], ray.get(actors[0].has_policies.remote()))


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
    (cluster/request_channel.py), as the router makes them now."""

    def __init__(self, prefill, decode):
        self.prefill, self.decode = prefill, decode
        self.channels = None

    def pid(self) -> int:
        return os.getpid()

    async def run(self, concurrency: int, duration_s: float, max_tokens: int, path: str = "ray") -> list[float]:
        """Closed loop for `duration_s`; each request's latency in seconds."""
        import asyncio

        from pdcluster.cluster.messages import DecodeRequest, PrefillRequest, SamplingSpec
        from pdcluster.cluster.request_channel import EngineChannel

        assert path in FLOORS, f"unknown path {path!r}"
        if path == "channel" and self.channels is None:
            self.channels = [await EngineChannel(n, a, "127.0.0.1").connect()
                             for n, a in (("prefill-0", self.prefill), ("decode-0", self.decode))]
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompt = list(range(3, 15))
        latencies: list[float] = []
        end = time.monotonic() + duration_s

        async def one(rid: str) -> None:
            if path == "channel":
                p, d = self.channels
                pre = await p.call("prefill", PrefillRequest(rid, prompt, sampling)).next()
                call = d.call("decode", DecodeRequest(rid, prompt, sampling, pre.handle))
                while not call.done:
                    await call.next()
                return
            pre = await self.prefill.prefill.remote(PrefillRequest(rid, prompt, sampling))
            req = DecodeRequest(rid, prompt, sampling, pre.handle)
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


# ---- measuring ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    stream: bool
    connections: int

    @property
    def name(self) -> str:
        return f"{'stream' if self.stream else 'non-stream'} c{self.connections}"


@dataclass(frozen=True)
class Measurement:
    system: str
    setting: Setting
    load: LoadResult
    proxy_cpu_s: float
    backend_cpu_s: float

    @property
    def proxy_cpu_us_per_request(self) -> float:
        return self.proxy_cpu_s / self.load.requests * 1e6 if self.load.requests else float("nan")

    @property
    def backend_cpu_us_per_request(self) -> float:
        return self.backend_cpu_s / self.load.requests * 1e6 if self.load.requests else float("nan")


FLOORS = {"ray": "Ray calls alone (no HTTP)", "ray_one_reply": "Ray calls alone, D in one reply",
          "channel": "request channel alone (no HTTP)"}


def measure_floor(caller, caller_pid: int, engine_pids: list[int], setting: Setting, duration_s: float,
                  path: str) -> Measurement:
    """The CallsAlone actor at the setting's concurrency: requests/s, latency, its CPU."""
    import ray

    cpu0, back0 = cpu_seconds([caller_pid]), cpu_seconds(engine_pids)
    latencies = ray.get(caller.run.remote(setting.connections, duration_s, MAX_TOKENS, path))
    cpu = cpu_seconds([caller_pid]) - cpu0
    return Measurement(FLOORS[path], setting, ray_floor_result(latencies, duration_s, 0.0), cpu,
                       cpu_seconds(engine_pids) - back0)


def measure(system: System, setting: Setting, model: str, duration_s: float, scripts: Path) -> Measurement:
    system.before_run()
    script = _script(scripts, model, setting.stream)
    proxy0, back0 = cpu_seconds(system.proxy_pids), cpu_seconds(system.backend_pids)
    load = run_wrk(f"{system.url}/v1/completions", script, setting.connections, duration_s)
    return Measurement(system.name, setting, load, cpu_seconds(system.proxy_pids) - proxy0,
                       cpu_seconds(system.backend_pids) - back0)


def check_answers(system: System, model: str) -> None:
    """One request of each kind through the system: a 200 and the expected tokens, before timing it."""
    import httpx

    for stream in (False, True):
        r = httpx.post(f"{system.url}/v1/completions", json=request_body(model, stream), timeout=30)
        assert r.status_code == 200, f"{system.name}: HTTP {r.status_code}: {r.text[:500]}"
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]"), f"{system.name}: stream without [DONE]: {r.text[-300:]}"
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length", f"{system.name}: {r.text[:500]}"


def format_table(ms: Sequence[Measurement], settings: Sequence[Setting]) -> str:
    """One row per system: for each setting req/s (at c>1) or p50 ms (at c1), then CPU per request."""
    systems = list(dict.fromkeys(m.system for m in ms))
    by = {(m.system, m.setting): m for m in ms}
    head = ["system"]
    for s in settings:
        head.append(f"{s.name} {'p50 ms' if s.connections == 1 else 'req/s'}")
    head += [f"proxy CPU us/req ({settings[0].name})", f"backends CPU us/req ({settings[0].name})",
             "wrk CPU share (max)", "errors"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in systems:
        cells = [name]
        for s in settings:
            m = by.get((name, s))
            cells.append("-" if m is None else f"{m.load.p50_ms:.2f}" if s.connections == 1 else f"{m.load.rps:,.0f}")
        first = by.get((name, settings[0]))
        cells.append(f"{first.proxy_cpu_us_per_request:,.0f}" if first else "-")
        cells.append(f"{first.backend_cpu_us_per_request:,.0f}" if first else "-")
        mine = [m for m in ms if m.system == name]
        cells.append(f"{max(m.load.client_cpu_share for m in mine):.0%}")
        cells.append(str(sum(m.load.errors + m.load.non_2xx for m in mine)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def machine_note() -> str:
    import psutil

    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    busy = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid not in mine:
                p.cpu_percent(None)
                busy.append(p)
    time.sleep(1.0)
    others = []
    for p in busy:
        with contextlib.suppress(psutil.Error):
            pct = p.cpu_percent(None)
            if pct >= 10:
                others.append(f"{(p.info['name'] or '?')[:20]} {pct:.0f}%")
    load1, load5, _ = os.getloadavg()
    return (f"load average {load1:.2f} (1 min), {load5:.2f} (5 min); other processes over 10% of a core: "
            f"{', '.join(others) or 'none'}")


@contextlib.contextmanager
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="pdcluster-bench")
    try:
        yield
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=8, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=1, help="measurements per system and setting (medians)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--no-stream", action="store_true", help="skip the streaming settings")
    ap.add_argument("--vllm-router", default=DEFAULT_VLLM_ROUTER)
    ap.add_argument("--vllm-router-policies", default="round_robin,cache_aware")
    ap.add_argument("--toy-proxy", default=DEFAULT_TOY_PROXY)
    ap.add_argument("--pdc-policies", default="round_robin,prefix_aware",
                    help="pdcluster policies to measure (if its router has set_policy)")
    ap.add_argument("--routers", default="1",
                    help="comma-separated counts of pdcluster router processes sharing one port, a cluster each")
    ap.add_argument("--model-dir", default=".pdcluster/models/tiny-qwen3")
    ap.add_argument("--only", default="", help="comma-separated name prefixes of systems to run (default: all)")
    ap.add_argument("--profile", action="store_true",
                    help="then profile pdcluster's router and engine actors (py-spy) in one more c32 run")
    a = ap.parse_args()

    settings = [Setting(False, a.concurrency), Setting(False, 1)]
    if not a.no_stream:
        settings += [Setting(True, a.concurrency), Setting(True, 1)]
    spawned = Spawned()
    scripts = spawned.logs
    runs_dir = tempfile.mkdtemp(prefix="router-overhead-runs-")
    print(f"machine before: {machine_note()}", flush=True)
    try:
        with ray_session():
            clusters = [start_pdcluster(str(Path(a.model_dir).resolve()), runs_dir, routers=n)
                        for n in map(int, a.routers.split(","))]
            cluster = clusters[0]  # the one the floors and the profile use
            model = Path(a.model_dir).name
            systems = [pdc_system(c, v) for c in clusters
                       for v in pdc_variants(a.pdc_policies.split(",") if c.has_policies else [])]
            p_url, d_url, fake_pids = start_fake_backends(spawned)
            if Path(a.vllm_router).exists():
                systems += [start_vllm_router(spawned, a.vllm_router, pol, p_url, d_url, fake_pids)
                            for pol in a.vllm_router_policies.split(",") if pol]
            else:
                print(f"vllm-router not found at {a.vllm_router}: skipped", flush=True)
            if Path(a.toy_proxy).exists():
                systems.append(start_toy_proxy(spawned, a.toy_proxy, p_url, d_url, fake_pids))
            else:
                print(f"toy proxy not found at {a.toy_proxy}: skipped", flush=True)
            if a.only:
                systems = [s for s in systems if s.name.startswith(tuple(a.only.split(",")))]
            caller = None
            floors = [p for p, name in FLOORS.items() if not a.only or name.startswith(tuple(a.only.split(",")))]
            if floors:
                import ray

                caller = ray.remote(CallsAlone).options(num_cpus=0, max_concurrency=1000).remote(*cluster.engines)
                caller_pid = ray.get(caller.pid.remote())
                for path in floors:
                    ray.get(caller.run.remote(4, 1.0, MAX_TOKENS, path))  # warm-up
            for s in systems:
                s.before_run()
                check_answers(s, model)
                run_wrk(f"{s.url}/v1/completions", _script(scripts, model, False), a.concurrency, 1.0)  # warm-up
            results: list[Measurement] = []
            for r in range(a.rounds):
                for setting in settings:
                    runs = [lambda s=s: measure(s, setting, model, a.duration, scripts) for s in systems]
                    if caller is not None and not setting.stream:  # D's stream is read either way
                        runs[:0] = [lambda path=path: measure_floor(caller, caller_pid, cluster.engine_pids,
                                                                    setting, a.duration, path)
                                    for path in floors]
                    for run in runs:
                        m = run()
                        results.append(m)
                        print(f"round {r} {setting.name:15s} {m.system:36s} {m.load.rps:8,.0f} req/s  "
                              f"p50 {m.load.p50_ms:6.2f} ms  proxy {m.proxy_cpu_us_per_request:6,.0f} us/req  "
                              f"wrk {m.load.client_cpu_share:4.0%}  errors {m.load.errors + m.load.non_2xx}",
                              flush=True)
            print(f"machine after: {machine_note()}")
            print(format_table(median_measurements(results), settings))
            pdc = [s for s in systems if s.name.startswith("pdcluster")]
            if a.profile and pdc:
                from pdcluster.bench.router_profile import format_profiles

                print(f"profile of {pdc[0].name}, non-stream c{a.concurrency}:")
                print(format_profiles(profile_pdcluster(pdc[0], cluster, model, scripts, a.concurrency, a.duration)))
    finally:
        spawned.stop_all()


def profile_pdcluster(system: System, cluster: PdCluster, model: str, scripts: Path, connections: int,
                      duration_s: int, rate_hz: int = 100) -> list:
    """py-spy on the router and both engine actors during one non-streaming run: where their time goes."""
    from pdcluster.bench.router_profile import Profile, fold, record

    py_spy = Path(sys.executable).parent / "py-spy"
    system.before_run()
    procs = {"router": cluster.router_pids[0], "P engine": cluster.engine_pids[0], "D engine": cluster.engine_pids[1]}
    outs = {name: scripts / f"profile-{name.replace(' ', '-')}.txt" for name in procs}
    cpu0 = {name: cpu_seconds([pid]) for name, pid in procs.items()}
    spies = [record(pid, outs[name], duration_s + 1, rate_hz, str(py_spy) if py_spy.exists() else "py-spy")
             for name, pid in procs.items()]
    time.sleep(0.5)  # py-spy attached
    load = run_wrk(f"{system.url}/v1/completions", _script(scripts, model, False), connections, duration_s)
    cpu = {name: cpu_seconds([pid]) - cpu0[name] for name, pid in procs.items()}
    for spy in spies:
        _, err = spy.communicate(timeout=duration_s + 30)
        assert spy.returncode == 0, f"py-spy failed ({spy.returncode}): {err[-500:]}"
    print(f"profiled run: {load.rps:,.0f} req/s (py-spy slows it), {load.requests} requests", flush=True)
    return [Profile(name, fold(outs[name].read_text().splitlines()), rate_hz, duration_s, load.requests, cpu[name])
            for name in procs]


def _script(scripts: Path, model: str, stream: bool) -> Path:
    path = scripts / f"{'stream' if stream else 'plain'}.lua"
    if not path.exists():
        path.write_text(wrk_script(request_body(model, stream)))
    return path


def median_measurements(ms: Sequence[Measurement]) -> list[Measurement]:
    """Per system and setting, the round with the median throughput (one round: itself)."""
    groups: dict[tuple[str, Setting], list[Measurement]] = {}
    for m in ms:
        groups.setdefault((m.system, m.setting), []).append(m)
    out = []
    for group in groups.values():
        ranked = sorted(group, key=lambda m: m.load.rps)
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


if __name__ == "__main__":
    main()
