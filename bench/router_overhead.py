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
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdcluster.bench.router_systems import (
    FLOORS,
    CallsAlone,
    PdCluster,
    System,
    pdc_system,
    pdc_variants,
    ray_floor_result,
    start_fake_backends,
    start_pdcluster,
    start_toy_proxy,
    start_vllm_router,
)
from pdcluster.bench.wrk_load import MAX_TOKENS, LoadResult, Spawned, cpu_seconds, request_body, run_wrk, wrk_script

DEFAULT_VLLM_ROUTER = "/work/.venvs/vllm-router/bin/vllm-router"
DEFAULT_TOY_PROXY = "/work/.venvs/toy_proxy/toy_proxy_server.py"


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

                caller = ray.remote(CallsAlone).options(num_cpus=0, max_concurrency=1000).remote(*cluster.engines, cluster.secret)
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
