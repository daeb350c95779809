"""The simulated engine's cost model: how long a scheduler step takes, how many
bytes a request's state holds, how long moving them takes.

`SimParams.load(path)` reads one parameter file (params/*.yaml: a model's shape,
a device, a link, overheads and efficiencies, each number commented with its
source) and validates it; every problem raises `SimParamsError` naming the file
and the field. `CostModel(params, block_size)` answers the engine's questions:

- `prefill_step_s(chunks)`: one step computing prompt chunks, each
  `(new_tokens, history_tokens)`. FLOPs of the new tokens through the weights
  (2 x body params per token, plus the LM head once per chunk) and of their
  attention: over themselves (causal) and over the history already cached,
  each attention term counted as the layer structure says (full, sliding
  window, compressed, top-k sparse, indexer scores), divided by the device's
  peak x an efficiency; plus the KV of the whole context read once per layer;
  plus a fixed per-step overhead that part of the device work hides behind
  (eager mode: the host launches ops while the device runs the big ones);
  the step is never faster than reading the weights once.
- `decode_step_s(context_lens)`: weights read once per step, every request's
  KV read over its context (as its attention sees it: a window, the top-k
  selected entries, the compressed entries), the compute of the batch's tokens
  when it is larger than that, a per-step overhead and one per request. With speculative decoding
  (params `decode.speculative`) an iteration verifies draft+1 tokens per
  request and emits `accept_length` on average; the step returned is the
  iteration / accept_length: the time per emitted token, since the simulated
  engine emits one token per request per step.
- `mixed_step_s(chunks, context_lens)`: both in one step (chunked prefill +
  decode), sharing the weights read and the overhead.
- `state_bytes`, `blocks_to_send`: per component (one kind of per-request
  state, as vLLM's KV cache groups: full, window, compressed, state).
- `transfer_s(nbytes)`: link latency + bytes / bandwidth; `host_load_s(nbytes)`, the same over
  the host link (a host KV tier's loads, cluster/sim/tier.py).
- `kv_capacity_blocks()`: blocks of `block_size` tokens the device's KV memory
  holds, one block counting every full and compressed component (window and
  state components are per request, a few blocks each, and not counted).

An instance of several devices (`devices`, tensor parallel; params `parallel`): the matmuls and
attention split over them at the degree's efficiency, each device reads 1/t of the weights and its
share of the KV (all of it when the KV is not sharded), every layer adds its all-reduces of the
step's hidden states, KV memory is the devices' (less the weights' share each frees), and KV moves
over every device's port. At one device every figure is the file's, to the bit.

Pure Python: no engine, no device. What is modelled and what is not, and the
calibration against measured figures: docs/sim.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdcluster.cluster.sim.sim_params import (  # noqa: F401  (the parameter file, importable with the model)
    AttentionTerm,
    Component,
    ComponentKind,
    ComponentSpec,
    DecodeSpec,
    DeviceSpec,
    Efficiency,
    LinkSpec,
    ModelShape,
    Overheads,
    SimParams,
    SimParamsError,
    Speculative,
    _Strict,
)


def _sum_min_linear(lo: int, hi: int, slope: float, cap: float) -> float:
    """sum over t in (lo, hi] of min(slope * t, cap), as reals (t // ratio taken as t / ratio)."""
    if hi <= lo:
        return 0.0
    knee = math.floor(cap / slope) if math.isfinite(cap) else hi  # min() switches to cap past t = knee
    below_hi = min(hi, max(lo, knee))
    linear = slope * (below_hi * (below_hi + 1) - lo * (lo + 1)) / 2 if below_hi > lo else 0.0
    capped = hi - max(lo, below_hi)
    return linear + cap * capped if capped else linear


def _keys_sum(term: AttentionTerm, lo: int, hi: int) -> float:
    """Keys seen by the queries at context lengths lo+1 .. hi (each query: itself and all before it)."""
    if term.window:
        return _sum_min_linear(lo, hi, 1.0, term.window)
    cap = term.topk if term.topk else math.inf
    return _sum_min_linear(lo, hi, 1.0 / term.compress_ratio, cap)


class _DecodeBatch:
    """A decode batch's queries, one per context length (itself included), and the keys they read
    in all at each of `steps` steps (every context one longer at each): a float for one step, an
    array for several. A query reads min(context, window) keys, or context / compress_ratio
    entries, at most topk.

    Summed as integers (tokens, capped at window or topk x ratio), then divided by the ratio once:
    exact, so the order of the sum does not matter, and equal to the bit to summing each query's
    float when the ratio is a power of two (as in every parameter file). A batch wholly past a cap
    or wholly below it (the usual case) is summed without looking at each query."""

    def __init__(self, contexts: list[int], steps: int):
        self.contexts, self.steps = contexts, steps
        self.lo, self.hi, self.total = min(contexts), max(contexts) + steps - 1, sum(contexts)

    def keys(self, term: AttentionTerm) -> float | np.ndarray:
        """A float if the same at every step (the caller's arithmetic then broadcasts)."""
        cap = term.window or term.topk * term.compress_ratio or None  # in tokens; None: no cap
        n, steps = len(self.contexts), self.steps
        if cap is not None and self.lo >= cap:  # every query at its cap, at every step
            tokens = n * cap
        elif cap is None or self.hi <= cap:  # no query reaches it
            tokens = self.total if steps == 1 else self.total + n * np.arange(steps, dtype=np.int64)
        elif steps == 1:
            tokens = sum(min(c, cap) for c in self.contexts)
        else:
            at = np.add.outer(np.arange(steps, dtype=np.int64), np.asarray(self.contexts, dtype=np.int64))
            tokens = np.minimum(at, cap).sum(axis=1)
        return tokens / term.compress_ratio


def _entries_at(term: AttentionTerm, context: int) -> float:
    """Key entries a prefill chunk ending at this context reads once per layer: every query's top-k
    together cover about all the compressed entries, so no top-k cap here."""
    return min(context, term.window) if term.window else context / term.compress_ratio


def _maximum(a: float | np.ndarray, b: float | np.ndarray) -> float | np.ndarray:
    """np.maximum, in Python when both are floats (one step's)."""
    return max(a, b) if isinstance(a, float) and isinstance(b, float) else np.maximum(a, b)


def _any(condition: bool | np.ndarray) -> bool:
    return condition if isinstance(condition, bool) else bool(np.any(condition))


def _where(condition: bool | np.ndarray, a: float | np.ndarray, b: float | np.ndarray) -> float | np.ndarray:
    """np.where, in Python when the condition is one step's."""
    return (a if condition else b) if isinstance(condition, bool) else np.where(condition, a, b)


# ---- the cost model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepWork:
    """What one step (or each of several: arrays) computes and reads: everything of its time that
    does not depend on the device's efficiencies and overheads (`CostModel.step_seconds` adds
    those; cluster/sim/fit.py fits them over many steps' work at once)."""

    gemm_flops: float | np.ndarray = 0.0
    attention_self_flops: float | np.ndarray = 0.0
    attention_history_flops: float | np.ndarray = 0.0
    context_read_bytes: float | np.ndarray = 0.0  # prefill: the context's KV, once per layer
    decode_read_bytes: float | np.ndarray = 0.0  # decode: each request's KV as its attention reads it
    prefill: bool | np.ndarray = False  # it computes prompt chunks (the prefill overhead)
    decode: bool | np.ndarray = False  # it decodes (the decode overhead)
    decode_requests: float | np.ndarray = 0.0  # decode-shaped requests in it (the per-request overhead)
    speculative: bool | np.ndarray = False  # decode only, with speculation: an iteration / accept_length
    tokens: float | np.ndarray = 0.0  # tokens through the layers (new and decode): the all-reduces' size

    @staticmethod
    def stack(works: Sequence[StepWork]) -> StepWork:
        """Many steps' work as one, each field an array (one entry per step)."""
        return StepWork(*(np.array([np.asarray(getattr(w, f)).reshape(-1)[0] for w in works])
                          for f in StepWork.__dataclass_fields__))


class CostModel:
    """Step times, state sizes and transfer times from one parameter file and the engine's block
    size, for an instance of `devices` devices (a degree the file's `parallel` section prices)."""

    def __init__(self, params: SimParams, block_size: int, devices: int = 1):
        assert block_size > 0, f"block_size {block_size}: must be positive"
        params.check_degree(devices)
        self.params = params
        self.block_size = block_size
        self.devices = devices
        par = params.parallel
        # Divisors of the compute, the KV read and the weights' read; all 1 on one device (exact).
        self._compute_split = devices * par.efficiency[devices] if par else 1
        self._kv_split = devices if par and par.kv_sharded else 1
        self.components: tuple[Component, ...] = tuple(self._component(c) for c in params.model.components)
        self._per_block_bytes = sum(c.bytes_per_block for c in self.components if c.kind in ("full", "compressed"))

    def _component(self, spec: ComponentSpec) -> Component:
        if spec.kind == "state":
            return Component(spec.name, "state", spec.layers * spec.bytes_per_entry)
        if spec.kind == "compressed" and self.block_size % spec.compress_ratio:
            raise SimParamsError(
                f"{self.params.name}: model.components {spec.name!r}: block_size {self.block_size} is not a "
                f"multiple of its compress_ratio {spec.compress_ratio}; a block must hold whole entries")
        entries = self.block_size // spec.compress_ratio
        return Component(spec.name, spec.kind, spec.layers * spec.bytes_per_entry * entries,
                         window_tokens=spec.window_tokens, compress_ratio=spec.compress_ratio)

    # -- step times --

    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One scheduler step computing several prompts' chunks at once: (new_tokens, history_tokens) each,
        history = tokens before the chunk already in the KV cache (prefix hit or earlier chunks)."""
        assert chunks, "prefill_step_s: no chunks; a step with nothing to compute is not a step"
        return self._step_s(chunks, ())[0]

    def prefill_s(self, new_tokens: int, history_tokens: int, budget: int) -> float:
        """A prompt's whole prefill alone on an instance: steps of at most `budget` new tokens
        (max_num_batched_tokens, vLLM's chunked prefill), each over the history before it."""
        assert budget > 0, f"prefill_s: budget {budget}"
        total = 0.0
        while new_tokens > 0:
            step = min(new_tokens, budget)
            total += self.prefill_step_s([(step, history_tokens)])
            history_tokens, new_tokens = history_tokens + step, new_tokens - step
        return total

    def decode_step_s(self, context_lens: Sequence[int]) -> float:
        """One decode step of a batch: one new token per running request, each over its context
        (with speculative decoding: one iteration / accept_length)."""
        return self.decode_steps_s(context_lens, 1)[0]

    def decode_steps_s(self, context_lens: Sequence[int], steps: int) -> list[float]:
        """`decode_step_s` of `steps` consecutive steps of one batch, every context one token
        longer at each step than at the one before (the virtual clock runs them at once)."""
        assert context_lens, "decode_step_s: empty batch"
        assert steps >= 1, f"decode_steps_s: {steps} steps"
        return self._step_s((), context_lens, steps=steps)

    def mixed_step_s(self, chunks: Sequence[tuple[int, int]], context_lens: Sequence[int]) -> float:
        """A step with both chunked prefill and decode, as vLLM's scheduler makes them (speculative
        decoding not applied: one token per decode request)."""
        assert chunks or context_lens, "mixed_step_s: neither chunks nor decode requests"
        return self._step_s(chunks, context_lens)[0]

    def step_work(self, chunks: Sequence[tuple[int, int]], context_lens: Sequence[int], steps: int = 1) -> StepWork:
        """The work of a step as the scheduler makes it: prompt chunks and/or decode requests;
        a decode-only step with speculative decoding verifies draft_tokens + 1 per request."""
        spec = self.params.decode.speculative
        speculative = spec is not None and not chunks
        return self._work(chunks, context_lens, spec.draft_tokens + 1 if speculative else 1, steps, speculative)

    def _step_s(self, chunks: Sequence[tuple[int, int]], context_lens: Sequence[int], steps: int = 1) -> list[float]:
        """Each of `steps` steps' time (the decode contexts one longer at each)."""
        seconds = self._seconds(self.step_work(chunks, context_lens, steps))
        return seconds.tolist() if isinstance(seconds, np.ndarray) else [float(seconds)] * steps

    def step_seconds(self, work: StepWork) -> np.ndarray:
        """The time of a step's work (arrays: of each step's) on this device, with these
        efficiencies and overheads."""
        return np.atleast_1d(self._seconds(work))

    def _seconds(self, work: StepWork) -> float | np.ndarray:
        """step_seconds, a float if the work is one step's floats (the same arithmetic)."""
        p = self.params
        compute_s = (work.gemm_flops / (p.device.gemm_flops * p.efficiency.gemm)
                     + work.attention_self_flops / (p.device.attention_flops * p.efficiency.attention)
                     + work.attention_history_flops / (p.device.attention_flops * p.efficiency.attention_history)
                     ) / self._compute_split
        # Every forward reads the weights: a step of a few prefill tokens (D's recompute of the
        # last prompt token) is bandwidth-bound like a decode step.
        memory_s = ((p.model.weight_bytes_per_step / self.devices + work.decode_read_bytes / self._kv_split)
                    / (p.device.hbm_bytes_per_s * p.efficiency.memory_bandwidth))
        context_read_s = (work.context_read_bytes / self._kv_split
                          / (p.device.hbm_bytes_per_s * p.efficiency.prefill_kv_read))
        overhead_s = (_maximum(_where(work.prefill, p.overheads.prefill_step_s, 0.0),
                               _where(work.decode, p.overheads.decode_step_s, 0.0))
                      + p.overheads.decode_request_s * work.decode_requests)
        device_s = _maximum(compute_s, memory_s)
        seconds = overhead_s + _maximum(0.0, device_s - p.overheads.hidden_device_s) + context_read_s
        if self.devices > 1:  # a ring all-reduce moves 2 (t - 1) / t of the data through each device
            par, t = p.parallel, self.devices
            seconds = seconds + p.model.layers * par.collectives_per_layer * (
                par.collective_latency_s + 2 * (t - 1) / t * work.tokens * par.hidden_bytes / par.collective_bytes_per_s)
        spec = p.decode.speculative
        if spec is None or not _any(work.speculative):
            return seconds
        return _where(work.speculative, (seconds + spec.draft_s) / spec.accept_length, seconds)

    def _work(self, chunks: Sequence[tuple[int, int]], context_lens: Sequence[int],
              tokens_per_request: int, steps: int = 1, speculative: bool = False) -> StepWork:
        """The work of `steps` steps: what changes from step to step (the decode parts) an array, one
        entry per step; the rest floats."""
        m = self.params.model
        new_tokens = 0
        self_flops = history_flops = context_bytes = 0.0
        for new, history in chunks:
            assert new > 0 and history >= 0, f"chunk (new={new}, history={history}): new must be > 0, history >= 0"
            new_tokens += new
            for term in m.attention:
                alone = _keys_sum(term, 0, new)  # the chunk's tokens over themselves, as if no history
                self_flops += term.flops_per_pair * alone
                history_flops += term.flops_per_pair * (_keys_sum(term, history, history + new) - alone)
                context_bytes += term.layers * term.bytes_per_key * _entries_at(term, history + new)
        decode_tokens = tokens_per_request * len(context_lens)
        # Python floats, arrays only for what changes from step to step (a step's arithmetic
        # costs more in numpy calls than it computes).
        decode_bytes = 0.0
        if len(context_lens):
            assert min(context_lens) > 0, f"decode context lengths {list(context_lens)[:8]}: must be > 0"
            batch = _DecodeBatch([c + tokens_per_request for c in context_lens], steps)  # each query's, itself included
            for term in m.attention:
                keys = batch.keys(term)
                history_flops += term.flops_per_pair * keys * tokens_per_request
                decode_bytes += term.layers * term.bytes_per_key * keys
        gemm = 2 * m.body_params * (new_tokens + decode_tokens) + 2 * m.lm_head_params * (len(chunks) + decode_tokens)
        return StepWork(gemm, self_flops, history_flops, context_bytes, decode_bytes, prefill=bool(chunks),
                        decode=bool(len(context_lens)), decode_requests=float(len(context_lens)),
                        speculative=speculative, tokens=float(new_tokens + decode_tokens))

    # -- state and transfer --

    def _blocks(self, c: Component, num_tokens: int, d_cached_tokens: int) -> int:
        bs = self.block_size
        if c.kind == "state":
            return 1
        last = (num_tokens - 1) // bs  # the block holding the last token
        first = (num_tokens - c.window_tokens) // bs if c.kind == "window" and num_tokens > c.window_tokens else 0
        return last - max(first, d_cached_tokens // bs) + 1

    def _check_tokens(self, num_tokens: int, d_cached_tokens: int = 0) -> None:
        assert num_tokens > 0, f"num_tokens {num_tokens}: a request's state needs at least one token"
        assert 0 <= d_cached_tokens < num_tokens, (
            f"d_cached_tokens {d_cached_tokens} not in [0, num_tokens={num_tokens}): D's prefix hit never covers "
            f"the whole prompt (vLLM recomputes its last token)")

    def state_bytes(self, num_tokens: int) -> dict[str, int]:
        """Per component, bytes of a request's state at num_tokens, in whole blocks as the cache holds it."""
        self._check_tokens(num_tokens)
        return {c.name: self._blocks(c, num_tokens, 0) * c.bytes_per_block for c in self.components}

    def blocks_to_send(self, num_tokens: int, d_cached_tokens: int) -> dict[str, int]:
        """Per component, the blocks P sends D: window, only the tail; full and compressed, those past
        D's hit; state, its one slot."""
        self._check_tokens(num_tokens, d_cached_tokens)
        return {c.name: self._blocks(c, num_tokens, d_cached_tokens) for c in self.components}

    def blocks_to_load(self, num_tokens: int, d_cached_tokens: int) -> tuple[range, ...]:
        """Per component, in order, the indices of the prompt's blocks D loads from P: the last
        `blocks_to_send` of them. The simulated D (consumer.py) plans its pulls by it, the
        virtual clock (virtual/kv.py) its arrivals."""
        last = (num_tokens - 1) // self.block_size
        counts = self.blocks_to_send(num_tokens, d_cached_tokens)
        return tuple(range(last - counts[c.name] + 1, last + 1) for c in self.components)

    def transfer_s(self, nbytes: int) -> float:
        """Link latency + bytes / bandwidth (the link is each device's: t devices, t ports)."""
        assert nbytes >= 0, f"transfer of {nbytes} bytes"
        return self.params.link.latency_s + nbytes / (self.params.link.bytes_per_s * self.devices)

    @property
    def block_bytes(self) -> int:
        """One block of every full and compressed component: what a block of the pool (and of a host
        tier) holds."""
        return self._per_block_bytes

    def host_load_s(self, nbytes: int) -> float:
        """Host link latency + bytes / bandwidth: loading a host tier's blocks back (each device its
        own link, as `transfer_s`). SimParamsError if the file has no `host_link`."""
        link = self.params.host_link
        if link is None:
            raise SimParamsError(f"{self.params.name}: no host_link (host memory <-> device bandwidth and "
                                 f"latency): a host KV tier's loads cannot be priced without it")
        return link.latency_s + nbytes / (link.bytes_per_s * self.devices)

    def kv_capacity_blocks(self) -> int:
        """Blocks per instance the device's KV memory holds (one block: every full and compressed component)."""
        assert self._per_block_bytes > 0, f"{self.params.name}: no full or compressed component to size blocks by"
        kv_bytes = self.params.device.kv_cache_bytes
        if self.devices > 1:  # each device frees its share of the weights; holds 1/t of the KV, or all of it
            t, par = self.devices, self.params.parallel
            kv_bytes = (kv_bytes + par.weight_memory_bytes * (1 - 1 / t)) * self._kv_split
        return int(kv_bytes // self._per_block_bytes)
