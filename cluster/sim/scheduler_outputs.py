"""What the end of a step produces in the simulated engine's scheduler (scheduler_core.py):
each request's computed tokens counted, its next output ids drawn, its stop reason, its tokens
batched into deltas on `req.out`, and a finished request's blocks kept for D or freed.

`StepOutputs` is `SchedulerCore`'s half that runs after a step; it reads the core's config,
hooks, host tier, clock and queues (`self.config`, `self.hooks`, `self.tier`, `self.now_ns`,
`self.running`, `self.held`) and frees blocks through its `_free_blocks`.
"""

from __future__ import annotations

from pdcluster.cluster.sim.request import Delta, SimRequest, Status
from pdcluster.cluster.sim.scheduler_config import ScheduledChunk


class StepOutputs:
    def _after_step(self, batch: list[ScheduledChunk], steps: int = 1) -> None:
        """`steps` > 1: that many decode steps of `batch` (repeatable_steps), ended at the
        times `step_ends_ns` gives."""
        now_ns = self.now_ns()
        ends_ns = self.step_ends_ns(steps) if steps > 1 else (now_ns,)
        prompt_steps = False
        for chunk in batch:
            req = chunk.req
            if req.status is not Status.RUNNING:  # aborted during the step
                continue
            start = req.num_computed_tokens
            req.num_computed_tokens += chunk.num_new_tokens + steps - 1
            if start < req.num_prompt_tokens:
                assert steps == 1, f"{req.request_id}: prompt tokens in a repeated step (repeatable_steps is off)"
                # The blocks the step loaded from the host tier are written by it too (P's source
                # serves them to D as any other it holds).
                self.hooks.computed(req, start - chunk.tier_tokens, min(req.num_computed_tokens, req.num_prompt_tokens))
                prompt_steps = True
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk short of the end: nothing sampled yet
            tokens = self._draw_tokens(req, steps)
            if not req.first_token_ns:
                req.first_token_ns = ends_ns[0]
            req._pending += tokens
            req._pending_ns += ends_ns
            reason = self._stop_reason(req, tokens[-1])
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            else:
                self._maybe_flush(req)
        if prompt_steps:
            self.hooks.step_done()

    def step_ends_ns(self, steps: int) -> tuple[int, ...]:
        """When each of `steps` repeated steps ended (a driver that repeats steps says)."""
        raise NotImplementedError("this driver does not repeat steps")

    def _draw_tokens(self, req: SimRequest, n: int) -> list[int]:
        """The request's next n output tokens, appended to it: each from the context before it,
        as a greedy model's."""
        out = []
        for _ in range(n):
            out.append(req.next_token(self.config.vocab_size))
            req.output_token_ids.append(out[-1])
        return out

    def _stop_reason(self, req: SimRequest, token: int) -> str | None:
        if len(req.output_token_ids) > req.min_tokens:  # (vLLM masks them before: here they just do not stop it)
            if not req.ignore_eos and token == self.config.eos_token_id:
                return "stop"
            if token in req.stop_token_ids:
                return "stop"
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _maybe_flush(self, req: SimRequest) -> None:
        now = self.now_ns() / 1e9
        first = len(req.output_token_ids) == len(req._pending)  # the first token goes out at once
        if first or now - req._last_flush >= self.config.delta_interval_s:
            self._flush(req, None)
            req._last_flush = now

    def _flush(self, req: SimRequest, reason: str | None) -> None:
        req.out.put_nowait(Delta(req._pending, tuple(req._pending_ns), reason))
        req._pending, req._pending_ns = [], []

    def _finish(self, req: SimRequest, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.kv_ready_ns == 0 and req.external_tokens and req.blocks:
            # Aborted while its KV arrives: the load writes into its blocks until it ends.
            self.hooks.cancel_load(req)
            self._flush(req, reason)
            return
        if self.tier is not None:  # write-through: its computed prompt blocks, before they may be freed
            bs = self.config.block_size
            n = min(len(req.block_hashes), len(req.blocks), req.num_computed_tokens // bs, req.num_prompt_tokens // bs)
            self.tier.finished(req.block_hashes, req.prompt_token_ids, n, self.now_ns() / 1e9, req.retain_s)
        keep = self.hooks.finished(req)
        if keep:
            req.held_for_transfer = True
            self.held[req.request_id] = req
        else:
            self._free_blocks(req)
        self._flush(req, reason)
