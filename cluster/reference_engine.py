"""A single plain vLLM engine: no connector, prefix caching off (on, for warm-cache benchmarks).

It gets the same run-time vLLM patches as a cluster engine of the same model
(DeepSeek-V4: cluster/vllm_patches.py), so only the P/D split differs.

What a P/D cluster's output must equal token for token, and the TTFT it is
compared with. Host it in a Ray actor: `ray.remote(ReferenceEngine)`.

`GreedyReference` is the same engine run inside its actor's process (vLLM's in-process
engine core, one worker in-process): outputs only, since its latency has no engine-core
process as the cluster's have; it starts sooner, one interpreter importing vLLM instead of two
(bench/README.md, "The reference engines").
"""

from __future__ import annotations

import os
import time


def _engine_args(model: str, cpu_bind: str | None, max_model_len: int, dtype: str, block_size: int,
                 kv_cache_space_gib: int, enable_prefix_caching: bool, in_process: bool) -> dict:
    """The engine's arguments, after this process's env is set for them: vLLM's CPU settings and
    the run-time vLLM fixes the model needs, as the cluster's engines get them
    (cluster/vllm_patches.py), for this process and the engine processes it starts."""
    from pdcluster.cluster import vllm_patches

    vllm_patches.check_model_runs_here(model, "cpu")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib)
    if cpu_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    model_sets = vllm_patches.patch_sets_for_model(model, "cpu")
    os.environ.update(vllm_patches.engine_env([*vllm_patches.patch_sets_for_device("cpu"), *model_sets]))
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        for patch_set in model_sets:  # no engine process starts here to apply them (vllm_site)
            vllm_patches.apply(patch_set)
    return dict(model=model, skip_tokenizer_init=True, enable_prefix_caching=enable_prefix_caching,
                block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=max_model_len, dtype=dtype,
                enforce_eager=True)


class ReferenceEngine:
    def __init__(self, model: str, cpu_bind: str | None = "0", max_model_len: int = 8192, dtype: str = "float32",
                 block_size: int = 128, kv_cache_space_gib: int = 1, enable_prefix_caching: bool = False):
        args = _engine_args(model, cpu_bind, max_model_len, dtype, block_size, kv_cache_space_gib,
                            enable_prefix_caching, in_process=False)
        from pdcluster.transfer import refusal_counts
        from pdcluster.transfer.vllm_compat import AsyncEngineArgs, AsyncLLM

        # vLLM's ZMQ sockets in a directory of this process's own, removed with it (or swept at the
        # next start on the host), as the cluster's engines' are (cluster/engine_actor.py).
        os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.dirname(refusal_counts.share()))

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    async def _run(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, dict[str, float]]:
        from pdcluster.transfer.vllm_compat import SamplingParams, TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        t0 = time.monotonic()  # vLLM's request timestamps are on this clock
        ttft, out, parts = None, None, {}
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp,
                                           request_id=f"ref-{time.monotonic_ns()}"):
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.monotonic() - t0
                m = out.metrics  # RequestStateStats: queued and scheduled in the core, first token's step
                if m is not None and m.queued_ts and m.first_token_ts:
                    parts = {"submit_to_queued": m.queued_ts - t0, "queued_to_first": m.first_token_ts - m.queued_ts,
                             "first_to_caller": ttft - (m.first_token_ts - t0)}
        return list(out.outputs[0].token_ids), ttft, parts

    async def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy output tokens (EOS ignored)."""
        return (await self._run(prompt, max_tokens))[0]

    async def ttft(self, prompt: list[int]) -> float:
        """Seconds from submission to the first token."""
        return (await self._run(prompt, 1))[1]

    async def ttft_parts(self, prompt: list[int]) -> tuple[float, dict[str, float]]:
        """TTFT in seconds and its parts (seconds): submission to queued in the engine core
        (input processing, IPC), queued to the first token's step end, and that token's way
        back to this caller."""
        _, ttft, parts = await self._run(prompt, 1)
        return ttft, parts

    async def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (with enable_prefix_caching): for cold-vs-warm benchmarks."""
        return await self.llm.reset_prefix_cache()


class GreedyReference:
    """The reference engine in its actor's own process: `greedy` outputs only (module docstring)."""

    def __init__(self, model: str, cpu_bind: str | None = "0", max_model_len: int = 8192, dtype: str = "float32",
                 block_size: int = 128, kv_cache_space_gib: int = 1):
        args = _engine_args(model, cpu_bind, max_model_len, dtype, block_size, kv_cache_space_gib,
                            enable_prefix_caching=False, in_process=True)
        from pdcluster.transfer.vllm_compat import EngineArgs, LLMEngine

        self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self._ids = 0

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy output tokens (EOS ignored)."""
        from pdcluster.transfer.vllm_compat import SamplingParams

        return self._tokens(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                   detokenize=False))

    def sample(self, prompt: list[int], spec) -> list[int]:
        """Output tokens with the vLLM sampling parameters the cluster's engines make of `spec`
        (a proto SamplingSpec: cluster/engine_actor.py:sampling_params)."""
        from pdcluster.cluster.engine_actor import sampling_params

        return self._tokens(prompt, sampling_params(spec))

    def logprobs(self, prompt: list[int], spec) -> list:
        """The logprobs of each output token (spec.logprobs set), as the cluster's D sends them
        (proto TokenLogprobs)."""
        from pdcluster.cluster.engine_actor import sampling_params
        from pdcluster.proto.messages import TokenLogprobs

        return [TokenLogprobs.from_vllm(p) for p in self._final(prompt, sampling_params(spec)).outputs[0].logprobs]

    def prompt_logprobs(self, prompt: list[int], spec) -> tuple:
        """The prompt's logprobs (spec.prompt_logprobs set), as the cluster's P sends them."""
        from pdcluster.cluster.engine_actor import sampling_params
        from pdcluster.proto.messages import TokenLogprobs

        return TokenLogprobs.prompt_from_vllm(self._final(prompt, sampling_params(spec)).prompt_logprobs)

    def _tokens(self, prompt: list[int], params) -> list[int]:
        return list(self._final(prompt, params).outputs[0].token_ids)

    def _final(self, prompt: list[int], params):
        from pdcluster.transfer.vllm_compat import RequestOutputKind, TokensPrompt

        params.output_kind = RequestOutputKind.FINAL_ONLY
        self._ids += 1
        rid = f"ref-{self._ids}"
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        final = None
        while self.engine.has_unfinished_requests():
            final = next((out for out in self.engine.step() if out.request_id == rid and out.finished), final)
        assert final is not None, f"the reference engine ended {rid} without a final output"
        return final
