"""`pdc`: the command line.

  pdc model tiny OUT_DIR [--arch qwen3] [--seed N]   a tiny random-weight model (qwen3, llama, gemma3, gptoss, dsv4); --force to replace files
  pdc up SPEC.yaml                                   start a cluster, return when healthy
  pdc status [--name NAME]                           list instances: role, address, health
  pdc down [--name NAME]                             stop what `pdc up` started
  pdc demo [SPEC.yaml] [--replay c90]                up, a few requests, a replay, down (the README's main job)
  pdc timeline summary|show|export|report RUN ...    per-request, per-phase timelines of a run
  pdc bench run [--preset c90-tiny] [...]            replay a load (AISBench metrics, joined timelines)
  pdc sim run SPEC [--preset c90] [...]              the same load on the simulated cluster's virtual clock
  pdc sim fit RUN --params BASE --out NEW.yaml       fit a parameter file to a run's timelines
  pdc plan PARAMS --devices 16 --preset c90 --slo-ttft-ms MS --slo-tpot-ms MS  P:D split and settings for an SLO
  pdc lab up|status|down|exec|link|kill|revive|partition|heal   rehearse N hosts (cluster/lab.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STATE_DIR = Path(os.environ.get("PDC_STATE_DIR", Path.home() / ".pdcluster" / "state"))
DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "deploy" / "p1d1-tiny-cpu.yaml"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdcluster")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _fail(msg: str, code: int = 2) -> None:
    print(f"pdc: {msg}", file=sys.stderr)
    raise SystemExit(code)


def _load(path: str):
    from pdcluster.proto.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as err:
        _fail(str(err))


def cmd_model_tiny(a) -> None:
    from pdcluster.cluster.tiny_model import make_tiny_model

    out_dir = Path(a.out_dir)
    if a.seed < 0:
        _fail(f"--seed {a.seed}: 0 or more")
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir()) and not a.force):
        _fail(f"{out_dir} is not an empty folder: pdc model tiny writes a whole checkpoint there, replacing "
              f"what it holds (--force to do so)")
    out = make_tiny_model(out_dir, arch=a.arch, seed=a.seed)
    print(f"wrote tiny {a.arch} model (seed {a.seed}) to {out}")


def _ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


def _connect(spec) -> bool:
    """Connect to the spec's Ray (or a local one, started if needed: with token authentication and
    node-failure detection that tolerates the spec's partition_tolerance_s). True if we started it."""
    import ray

    from pdcluster.cluster.ray_settings import FailureDetection, use_ray_token
    from pdcluster.proto.names import NAMESPACE

    use_ray_token()  # this process, and the Ray it starts (its env), use the machine's Ray token
    detection = FailureDetection.tolerating(spec.partition_tolerance_s)
    started = False
    if spec.ray_address is not None:
        try:
            ray.init(address=spec.ray_address, namespace=NAMESPACE, log_to_driver=False)
        except (ConnectionError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            _fail(f"cannot join the Ray cluster at ray_address {spec.ray_address}: {first}. A Ray started with "
                  f"token authentication (as pdc up and pdc lab start theirs) answers only callers holding its "
                  f"token: this host needs the head's ~/.ray/auth_token (or RAY_AUTH_TOKEN) and RAY_AUTH_MODE "
                  f"unset or token; on the machine that runs the Ray head (a lab's too), ray_address: auto "
                  f"finds it", code=1)
    else:
        try:
            ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
        except (ConnectionError, RuntimeError):
            subprocess.run([_ray_bin(), "start", "--head", f"--num-cpus={os.cpu_count()}", "--include-dashboard=false",
                            "--disable-usage-stats", detection.ray_start_arg()], check=True, capture_output=True)
            started = True
            ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    _check_failure_detection(spec, detection)
    return started


def _check_failure_detection(spec, want) -> None:
    """A Ray cluster of several hosts that declares a host dead sooner than the spec tolerates: say so."""
    import ray
    import ray._private.state

    from pdcluster.cluster.ray_settings import FailureDetection

    if len([n for n in ray.nodes() if n["Alive"]]) < 2:
        return  # one host: no partition to tolerate
    have = FailureDetection.of_cluster(ray._private.state.state.get_system_config())
    if have.tolerance_s < want.tolerance_s:
        print(f"pdc up: warning: this Ray cluster declares a host dead {have.tolerance_s:g} s after it becomes "
              f"unreachable, below the spec's partition_tolerance_s ({spec.partition_tolerance_s:g} s): a shorter "
              f"cut loses that host's instances until it rejoins. Start the head with\n  ray start --head "
              f"'{want.ray_start_arg()}' ...", file=sys.stderr)


def cmd_up(a) -> None:
    from pdcluster.cluster.launch import ClusterStartError, build_cluster, find_actors

    spec = _load(a.spec)
    if spec.prefill.instances == 0:
        _fail(f"{a.spec}: prefill.instances: 0 (no disaggregation) runs on the virtual clock only: "
              f"pdc sim run {a.spec}, or pdc plan, which compares it with the P/D splits")
    from pdcluster.cluster.check import router_reach

    if (reach := router_reach(spec)) is not None:
        print(f"pdc up: warning: {reach.what}", file=sys.stderr)
    started_ray = _connect(spec)
    if find_actors(spec.name):
        _fail(f"cluster {spec.name!r} is already up (pdc status; pdc down --name {spec.name})")
    t0 = time.monotonic()
    try:
        cluster = build_cluster(spec, detached=True)
    except ClusterStartError as err:
        if started_ray:
            subprocess.run([_ray_bin(), "stop"], capture_output=True)
        _fail(str(err), code=1)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{spec.name}.json").write_text(json.dumps(
        {"name": spec.name, "spec": str(Path(a.spec).resolve()), "url": cluster.url, "started_ray": started_ray,
         "ray_address": spec.ray_address, "run_dir": cluster.run_dir, "checkout": CHECKOUT}))
    print(f"cluster {spec.name!r} up in {time.monotonic() - t0:.0f} s: P{len(cluster.prefill)} D{len(cluster.decode)}")
    for info in cluster.infos:
        print(f"  {info.name:<10} {info.role:<8} pid {info.pid:<7} node {info.node_ip}")
        print(f"  {'':<10} {_planes(info)}")
    print(f"endpoint: {cluster.url}/v1  (model {spec.model.served_name!r})")
    if cluster.run_dir:
        print(f"timelines: {cluster.run_dir}  (pdc timeline summary {cluster.run_dir})")


# The checkout (or install) this pdc runs from: `pdc up` records it, and `pdc down` without
# --name or --all stops only the clusters it started.
CHECKOUT = str(Path(__file__).resolve().parents[1])


def _states(name: str | None, everyone: bool = True) -> list[dict]:
    """The `pdc up` records: one by name, every one, or (everyone False) this checkout's."""
    files = [STATE_DIR / f"{name}.json"] if name else sorted(STATE_DIR.glob("*.json"))
    states = [json.loads(f.read_text()) for f in files if f.exists()]
    return states if name or everyone else [st for st in states if st.get("checkout") == CHECKOUT]


def _join_ray(st: dict) -> None:
    """Connect to the Ray cluster a `pdc up` state file names (once per process)."""
    import ray

    from pdcluster.proto.names import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=st["ray_address"] or "auto", namespace=NAMESPACE, log_to_driver=False)


def cmd_status(a) -> None:
    import ray

    from pdcluster.cluster.launch import find_actors
    from pdcluster.proto.names import is_router

    states = _states(a.name)
    if not states:
        print("no cluster started by pdc up" + (f" named {a.name!r}" if a.name else ""))
        return
    for st in states:
        try:
            _join_ray(st)
        except (ConnectionError, RuntimeError) as err:
            print(f"{st['name']}: Ray is not reachable ({err})")
            continue
        actors = find_actors(st["name"])
        print(f"cluster {st['name']!r}  endpoint {st['url']}/v1  ({len(actors)} actors)")
        if st.get("run_dir"):
            print(f"  timelines {st['run_dir']}")
        for full, handle in sorted(actors.items()):
            inst = full.split(":", 1)[1]
            if is_router(inst):
                print(f"  {inst:<10} router   {st['url']}")
                continue
            try:
                info = ray.get(handle.info.remote(), timeout=10)
                healthy = ray.get(handle.health.remote(), timeout=10)
                print(f"  {inst:<10} {info.role:<8} {'healthy' if healthy else 'UNHEALTHY':<9} "
                      f"pid {info.pid} node {info.node_ip}")
                print(f"  {'':<10} {_planes(info)}")
            except Exception as err:
                print(f"  {inst:<10} {'?':<8} DOWN      {type(err).__name__}")


def _planes(info) -> str:
    """Where an instance's planes listen, as it advertises them."""
    p = info.planes
    parts = [f"requests {p.request_channel}"]
    if info.kv_address:
        parts.append(f"kv {info.kv_address}")
    parts.append(f"kv events {p.kv_events.removeprefix('tcp://')} (replay {p.kv_events_replay.removeprefix('tcp://')})")
    return "  ".join(parts)


def cmd_down(a) -> None:
    import ray

    from pdcluster.cluster.launch import find_actors, stop_routers
    from pdcluster.proto.names import is_router

    if a.name and a.all:
        _fail("--name and --all: stop one cluster, or every one")
    states = _states(a.name, everyone=a.all)
    if not states:
        others = len(_states(None)) if not (a.name or a.all) else 0
        _fail("no cluster started by pdc up" + (f" named {a.name!r}" if a.name else " from this checkout" if others
                                                  else "")
              + (f" ({others} from elsewhere: pdc status lists them, pdc down --name NAME or --all stops them)"
                 if others else ""), code=1)
    for st in states:
        try:
            _join_ray(st)
            actors = find_actors(st["name"])
            stop_routers({full: h for full, h in actors.items() if is_router(full.split(":", 1)[1])})
            for full, handle in actors.items():
                ray.kill(handle, no_restart=True)
                print(f"stopped {full}")
        except (ConnectionError, RuntimeError) as err:
            print(f"{st['name']}: Ray is not reachable ({err}); nothing to stop")
        if st["started_ray"]:
            ray.shutdown()
            subprocess.run([_ray_bin(), "stop"], capture_output=True)
            print("stopped the local Ray that pdc up started")
        (STATE_DIR / f"{st['name']}.json").unlink(missing_ok=True)


def cmd_check(a) -> None:
    from pdcluster.cluster.check import check

    spec = _load(a.spec)  # the spec's own errors: exit 2, each field named
    print(f"{a.spec}: the spec is valid ({spec.device}, P{spec.prefill.instances} D{spec.decode.instances}, "
          f"{spec.role_engine('prefill').kind} engines)")
    findings = check(spec)
    for f in findings:
        print(f)
    failed = [f for f in findings if f.level == "FAIL"]
    if failed:
        _fail(f"{len(failed)} check(s) failed: pdc up {a.spec} would not start")


def cmd_demo(a) -> None:
    from pdcluster.cluster.demo import run_demo

    run_demo(_load(a.spec), replay=None if a.no_replay else a.replay)


def build_parser() -> argparse.ArgumentParser:
    """Every `pdc` command (the tests parse the README's command lines with it)."""
    from pdcluster.cluster.replay.presets import PRESETS

    ap = argparse.ArgumentParser(prog="pdc", description="prefill/decode disaggregated vLLM clusters on Ray")
    ap.add_argument("--version", action="version", version=f"pdc {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="what", required=True)
    tiny = model.add_parser("tiny", help="write a tiny random-weight checkpoint with a locally trained tokenizer")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="qwen3", choices=["qwen3", "llama", "gemma3", "gptoss", "dsv4"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--force", action="store_true", help="write into a folder that holds files (replacing them)")
    tiny.set_defaults(fn=cmd_model_tiny)
    up = sub.add_parser("up", help="start a cluster from a spec; returns when every instance is healthy")
    up.add_argument("spec")
    up.set_defaults(fn=cmd_up)
    check = sub.add_parser("check", help="validate a spec without launching it: fields, model, vLLM, device, ports")
    check.add_argument("spec")
    check.set_defaults(fn=cmd_check)
    status = sub.add_parser("status", help="list the clusters pdc up started, and their instances")
    status.add_argument("--name", default=None, help="one cluster (default: every one pdc up started)")
    status.set_defaults(fn=cmd_status)
    down = sub.add_parser("down", help="stop the clusters this checkout started (or --name, --all)")
    down.add_argument("--name", default=None, help="the cluster to stop, whichever checkout started it")
    down.add_argument("--all", action="store_true", help="every cluster pdc up started, from any checkout")
    down.set_defaults(fn=cmd_down)
    demo = sub.add_parser("demo", help="start a cluster, serve a few requests, stop it")
    demo.add_argument("spec", nargs="?", default=str(DEFAULT_SPEC))
    demo.add_argument("--replay", default="c90-tiny", choices=sorted(PRESETS),
                      help="the load replayed at the end (c90: the full preset, for deploy/p8d8-sim.yaml)")
    demo.add_argument("--no-replay", action="store_true", help="skip the replay at the end")
    demo.set_defaults(fn=cmd_demo)
    from pdcluster.cluster.lab_cli import add_lab_commands
    from pdcluster.cluster.plan_cli import add_plan_command
    from pdcluster.cluster.replay.bench_cli import add_bench_commands
    from pdcluster.cluster.sim_cli import add_sim_commands
    from pdcluster.router.timeline_cli import add_timeline_commands

    add_timeline_commands(sub)
    add_lab_commands(sub)
    add_bench_commands(sub)
    add_sim_commands(sub)
    add_plan_command(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    try:
        a.fn(a)
    except BrokenPipeError:  # `pdc ... | head` closed the pipe: stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
