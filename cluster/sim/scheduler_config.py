"""What the simulated engine's scheduler (scheduler_core.py) is configured with and talks to:
its engine args, the cost model's step times, the KV hooks around each step, a batch's entries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdcluster.cluster.sim.request import SimRequest


class StepCost(Protocol):
    """What the scheduler needs of the cost model (cluster/sim/cost.py)."""

    def prefill_step_s(self, chunks: Sequence[tuple[int, int]]) -> float: ...
    def decode_step_s(self, context_lens: Sequence[int]) -> float: ...
    def mixed_step_s(self, chunks: Sequence[tuple[int, int]], context_lens: Sequence[int]) -> float: ...
    def decode_steps_s(self, context_lens: Sequence[int], steps: int) -> list[float]: ...


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    long_prefill_token_threshold: int = 0  # vLLM's per-request chunk cap; 0: none
    delta_interval_s: float = 0.1  # at most one Delta per request this often (Ray's per-message cost)
    recompute_on_load_failure: bool = False  # a failed load: compute the prompt here, or end with "error"
    max_lag_s: float = 0.5  # behind the modelled clock by more than this: restart it from now


class KvHooks:
    """The KV side of each step (engine.py implements it for P and D); these defaults move nothing."""

    def computed(self, req: SimRequest, start: int, end: int) -> None:
        """A step computed prompt tokens [start, end) of `req` into `req.blocks` (those it loaded
        from the host tier included)."""

    def step_done(self) -> None:
        """After the step's `computed` calls."""

    def start_load(self, req: SimRequest) -> None:
        """`req.blocks` are allocated: bring in its `external_tokens` past `req.hit_tokens`;
        report the end through SchedulerCore.load_ended."""
        raise NotImplementedError("this engine cannot load KV from elsewhere")

    def cancel_load(self, req: SimRequest) -> None:
        """`req` ended while loading; its blocks stay until load_ended."""

    def finished(self, req: SimRequest) -> bool:
        """`req` ended; True: keep its blocks until `SchedulerCore.release` names it."""
        return False

    def preempted(self, req: SimRequest) -> None:
        """`req`'s blocks are about to be reused."""

    def poll(self) -> None:
        """Called every step and every idle tick: report releases and ended loads."""


@dataclass(frozen=True)
class ScheduledChunk:
    req: SimRequest
    num_new_tokens: int
    tier_tokens: int = 0  # tokens loaded from the host tier in this step, before it computes


