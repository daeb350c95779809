"""The contract between the HTTP front end and whatever generates tokens.

The OpenAI-compatible app (router/openai_api.py) only knows `TokenBackend`; the
P/D dispatcher (router/pd_dispatch.py) implements it over the engine actors. Unit tests
of the HTTP layer use a small in-process backend instead of engines.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdcluster.proto.messages import SamplingSpec, TokenLogprobs
from pdcluster.router.openai_models import PdUsage


@dataclass(frozen=True)
class ModelCard:
    name: str
    max_model_len: int
    vocab_size: int  # valid token ids are 0 .. vocab_size-1
    # The engines compute logits (vLLM's do; the simulated engine's tokens have none): logprobs.
    logits: bool = True
    # The model's own sampling defaults for what a request leaves unset (router/generation_defaults.py)
    sampling_defaults: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request. The last chunk has `finish_reason`; each has the P/D report
    as `usage.pd` shows it, whole on the last chunk and as known so far on the others (a client
    that stops early, at a stop string, gets that one)."""

    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    pd: PdUsage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # on the last chunk, when the request asked
    stop_reason: int | None = None  # on the last: the stop token id that ended it (None: eos or none)
    # n > 1: the choice these tokens are of, and its end when this chunk ends it (finish_reason:
    # the request's last chunk alone); n = 1: 0, and choice_finish as finish_reason or None.
    index: int = 0
    choice_finish: str | None = None


class BackendError(Exception):
    """Generation failed; `status` is the HTTP status the client should see."""

    def __init__(self, message: str, status: int = 500, kind: str = "server_error", retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.retry_after_s = retry_after_s  # a 429's Retry-After header


class TokenBackend(abc.ABC):
    """Generates tokens for already-validated token-id prompts.

    Contract: `generate` yields at least one chunk; exactly the last has
    `finish_reason` set. It raises BackendError (never hangs) when the request
    cannot finish, and frees everything the request held when the consumer stops
    iterating early (client disconnect, stop string).
    """

    @abc.abstractmethod
    def model_card(self) -> ModelCard: ...

    @abc.abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                 arrival_ns: int | None = None, traceparent: str | None = None) -> AsyncIterator[GenerationChunk]:
        """`arrival_ns`: when the HTTP request arrived (time.monotonic_ns), for its timeline;
        `traceparent`: the client's W3C trace context, kept in its record (router/otlp.py)."""

    def admit(self) -> None:
        """Raise BackendError (a 429) if a request arriving now would be refused: the front end
        asks before it tokenizes, so that an overloaded router refuses at once. `generate`
        decides again (requests tokenized meanwhile count by then)."""

    async def health(self) -> dict[str, bool]:
        """Instance name -> healthy."""
        return {}
