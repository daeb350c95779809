"""A scheduled step's shape and duration in the simulated engine's scheduler (scheduler_core.py):
its prompt chunks and decode-shaped requests, its time from the cost model, and how many
identical decode steps follow it (`repeatable_steps`, which the virtual clock runs as one).

`StepShapes` is `SchedulerCore`'s half that reads a batch; it reads the core's config, cost
model, host tier, variation and queues (`self.config`, `self.cost`, `self.tier`, `self.variation`,
`self.steps`, `self.running`, `self.waiting`, `self._aborts`).
"""

from __future__ import annotations

from pdcluster.cluster.sim.request import Status
from pdcluster.cluster.sim.scheduler_config import ScheduledChunk


class StepShapes:
    def step_times_s(self, batch: list[ScheduledChunk], steps: int = 1) -> list[float]:
        """The durations of the next `steps` steps of this batch (more than one: `repeatable_steps`
        decode steps, each context one longer than at the one before), varied as the instance's
        steps vary (`self.variation`: their index on the instance decides their draws, however
        they are batched)."""
        contexts = self.decode_contexts(batch)
        durations = self.cost.decode_steps_s(contexts, steps) if steps > 1 else [self.step_s(batch)]
        if self.variation is None:
            return durations
        return self.variation.apply(durations, self.steps, decode=contexts is not None)

    def step_s(self, batch: list[ScheduledChunk]) -> float:
        """The batch's duration, from the cost model."""
        chunks, contexts = self._shape(batch)
        if not contexts:
            step = self.cost.prefill_step_s(chunks)
        elif not chunks:
            step = self.cost.decode_step_s(contexts)
        else:
            step = self.cost.mixed_step_s(chunks, contexts)
        loaded = sum(c.tier_tokens for c in batch) + self.loading_tier_tokens
        return step + self.tier.load_s(loaded) if loaded else step  # a synchronous load, before the compute

    def decode_contexts(self, batch: list[ScheduledChunk]) -> list[int] | None:
        """The batch's context lengths if every chunk of it is decode-shaped; None if it
        computes prompt chunks."""
        chunks, contexts = self._shape(batch)
        return None if chunks else contexts

    @staticmethod
    def _shape(batch: list[ScheduledChunk]) -> tuple[list[tuple[int, int]], list[int]]:
        """(prompt chunks as (new, history), decode-shaped context lengths) of a batch."""
        chunks, contexts = [], []
        for c in batch:
            r = c.req
            if c.num_new_tokens > 1 or r.num_computed_tokens == 0:
                chunks.append((c.num_new_tokens, r.num_computed_tokens))
            else:
                # One token over a cached context is decode-shaped, whether it samples the next
                # output or recomputes a prompt's last token (D after its load, P on a full hit):
                # one query row reading its context, as a decode request's.
                contexts.append(r.num_computed_tokens + 1)
        return chunks, contexts

    def repeatable_steps(self, batch: list[ScheduledChunk]) -> int:
        """How many steps, this one included, the scheduler would schedule exactly like this one
        (the same requests decoding one token each, nothing admitted, no block allocated or
        cached, nobody finishing before the last), if nothing comes in from outside meanwhile
        (an arrival, a load's end, a release, an abort). A driver may run them as one and cut
        them short at whichever step such an event falls in (cluster/sim/virtual/instance.py)."""
        c = self.config
        if self._aborts or self.decode_contexts(batch) is None or len(batch) != len(self.running):
            return 1
        if self.loading_tier_tokens:  # this step loads a tier hit for a pull it starts
            return 1
        # A waiting request that is not loading could be admitted at the next step.
        if len(self.running) < c.max_num_seqs and any(r.status is not Status.LOADING for r in self.waiting):
            return 1
        bs, steps = c.block_size, c.max_model_len
        for chunk in batch:
            req = chunk.req
            if req.stop_token_ids or (not req.ignore_eos and c.eos_token_id is not None):
                return 1  # a drawn token could end it at any step
            if not req.output_token_ids:
                return 1  # its first token goes out as soon as this step ends
            end = req.num_computed_tokens + 1  # the token this step computes, counted
            samples = min(req.max_tokens - len(req.output_token_ids), c.max_model_len - req.num_tokens)
            steps = min(steps, samples,  # it finishes at the last one at the latest
                        len(req.blocks) * bs - end + 1,  # no block to allocate after this one
                        bs - end % bs)  # no block filling up after this one
        return max(1, steps)
