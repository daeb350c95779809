"""A simulated engine's request: what it asks for, where the scheduler has it, and its tokens.

Tokens are pseudo-random ids within the vocabulary from the context before them: the last
`CONTEXT_TOKENS` tokens and the position (`context_token`), as a greedy model's next token
follows from its context. So the same prompt gives the same output on every instance, and a
request sent again as its prompt plus the tokens it had produced (router/migration.py) goes
on with exactly the tokens it would have produced. The scheduler (scheduler.py)
moves a request through `Status`; its outgoing tokens leave in batches (`Delta`).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import numpy as np


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # blocks allocated, KV arriving from elsewhere
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    token_ns: tuple[int, ...]
    finish_reason: str | None = None


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0  # neither EOS nor a stop token ends it before this many outputs (vLLM's)
    external_tokens: int = 0  # leading prompt tokens whose KV comes from elsewhere (D: from P)
    # The prompt's smallest and largest token id; None: found here (one pass over the prompt).
    # The virtual clock passes it, and the prompt's block hashes (`block_hashes`), worked out
    # once per prompt for every instance that serves it.
    id_range: tuple[int, int] | None = None
    # --- state
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # its block table: block ids (block_pool.py)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks of `blocks` already in the prefix cache
    num_cached_tokens: int = -1  # prefix hit when first scheduled (vLLM's num_cached_tokens); -1: not yet
    hit_tokens: int = 0  # the latest admission's hit (its host tier's part included)
    tier_tokens: int = 0  # of hit_tokens, those loaded from the instance's host tier (cluster/sim/tier.py)
    num_tier_tokens: int = 0  # of num_cached_tokens, the host tier's
    tier_load_tokens: int = 0  # tier tokens whose load the next step that schedules it pays for
    # A request loading past its hit (D pulling from P): its tier hit's load, in the step that
    # started it, before the pull (as D's worker runs it: docs/kv_tiers.md)
    tier_load_ns: int = 0
    retain_s: float = 0.0  # the request's retention hint for its prompt's blocks in the host tier
    finish_reason: str | None = None
    error: str | None = None
    queued_ns: int = 0
    scheduled_ns: int = 0
    first_token_ns: int = 0
    kv_ready_ns: int = 0  # D: the load ended (seen by the scheduler)
    held_for_transfer: bool = False  # finished, blocks kept until KvHooks releases them
    preemptions: int = 0
    # --- outgoing tokens
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    _pending: list[int] = field(default_factory=list)
    _pending_ns: list[int] = field(default_factory=list)
    _last_flush: float = 0.0

    def __post_init__(self):
        if self.id_range is None:  # one pass over the prompt as an array (checked on admission)
            ids = np.asarray(self.prompt_token_ids, dtype=np.int64)
            self.id_range = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)

    def next_token(self, vocab_size: int) -> int:
        """The token at position num_tokens: from the context before it."""
        n = self.num_tokens
        return context_token(self.tokens(max(0, n - CONTEXT_TOKENS), n), n, vocab_size)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, index: int) -> int:
        p = self.num_prompt_tokens
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        return [*self.prompt_token_ids[start:p], *self.output_token_ids[max(0, start - p):end - p]]

    def token_view(self) -> TokenView:
        """Prompt and output tokens as one sequence, without copying them (a 128K-token prompt's
        output blocks are hashed and cached from a few slices of it)."""
        return TokenView(self)


@dataclass(frozen=True)
class TokenView:
    """A request's tokens so far, sliced on demand (`SimRequest.tokens`)."""

    req: SimRequest

    def __len__(self) -> int:
        return self.req.num_tokens

    def __getitem__(self, index: slice) -> list[int]:
        assert isinstance(index, slice) and index.step is None, "a TokenView is read in slices"
        start, stop, _ = index.indices(self.req.num_tokens)
        return self.req.tokens(start, max(start, stop))


CONTEXT_TOKENS = 16  # how far back a token's context reaches


def context_token(context: list[int], position: int, vocab_size: int) -> int:
    """Pure: the token after `context` (its last CONTEXT_TOKENS count) at `position`."""
    m = (1 << 64) - 1
    seed = 0xCBF29CE484222325  # FNV-1a over the context's ids
    for t in context[-CONTEXT_TOKENS:]:
        seed = ((seed ^ t) * 0x100000001B3) & m
    return pseudo_token(seed, position, vocab_size)


def pseudo_token(seed: int, position: int, vocab_size: int) -> int:
    """splitmix64 of (seed, position): deterministic, uniform over the vocabulary."""
    m = (1 << 64) - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) % vocab_size
