"""One job's generation and its OpenAI shapes: backend chunks -> text deltas (stop strings
applied) -> a JSON body or server-sent events. router/openai_api.py validates the request into
a `Job` and serves what this returns."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdcluster.proto.messages import SamplingSpec, TokenLogprobs
from pdcluster.router.backend import BackendError, GenerationChunk, TokenBackend
from pdcluster.router.chat_parsers import RequestParsers
from pdcluster.router.http_app import aclose, error_body
from pdcluster.router.openai_models import PdUsage, PromptTokensDetails, Usage
from pdcluster.router.text_codec import Detokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """A validated request, ready for the backend."""

    request_id: str
    chat: bool
    model: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    arrival_ns: int  # time.monotonic_ns() when the HTTP request arrived
    traceparent: str | None = None  # the client's W3C trace context (router/otlp.py)
    echo: str | None = None  # completions' echo: the prompt's text, put before the answer's
    # chat's: the model's tool and reasoning parsers on each choice (router/chat_parsers.py)
    parsing: RequestParsers | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Delta:
    """New text for the client; the last one has `finish_reason` and `usage`."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    token_ids: list[int] = field(default_factory=list)  # generated ids this delta covers
    logprobs: tuple[TokenLogprobs, ...] = ()  # theirs, when the request asked
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # on the last, when the request asked
    stop_reason: int | str | None = None  # on the last, as vLLM's: the stop string or stop token id that ended it
    index: int = 0  # the choice (n > 1); `finish_reason` is its end, `usage` comes on the request's last delta


def _find_stop(text: str, stops: tuple[str, ...], start: int, floor: int = 0) -> tuple[str, int] | None:
    """The stop string in text[start:] that completes first past `floor` (the text of the first
    min_tokens tokens, where vLLM's detokenizer looks for none), ties in the list's order (vLLM's
    check_stop_strings), and where it starts."""
    hits = [(i + len(s), n, s, i) for n, s in enumerate(stops) if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
    return min(hits)[2:] if hits else None


def _usage(job: Job, completion_tokens: int, last: GenerationChunk | None) -> Usage:
    pd = last.pd if last is not None and last.pd is not None else \
        PdUsage(p_cached_tokens=0, d_cached_tokens=0, transferred_tokens=0)
    return Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=completion_tokens,
                 total_tokens=len(job.prompt_ids) + completion_tokens,
                 # The hit of the cache that served the prefill: P's, or D's own when D prefilled it
                 # (with what it read from a P's tier: computed by none).
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=pd.d_cached_tokens + pd.pool_tokens if pd.local_prefill else pd.p_cached_tokens),
                 pd=pd)


class _ChoiceText:
    """One choice's text as its tokens come: detokenized, stop strings matched past the text of
    its first min_tokens tokens (vLLM's detokenizer looks for none there), streamed text held back
    by len(longest stop)-1 characters so that a stop split across tokens never reaches the client."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], min_tokens: int):
        self._detok, self._eos = Detokenizer(tokenizer), tokenizer.eos_token_id
        self._stops, self._min_tokens = stops, min_tokens
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._text, self._sent, self._scanned, self._floor = "", 0, 0, 0
        self.tokens = 0  # generated tokens taken (vLLM's count: up to the one that stopped it)
        self.done = False

    def take(self, ids: list[int], finish: str | None) -> tuple[str, str | None, str | None]:
        """(the text the client gets now, the choice's finish, the stop string that ended it)."""
        before, self.tokens = self.tokens, self.tokens + len(ids)
        if finish == "stop" and ids and ids[-1] == self._eos:
            ids = ids[:-1]  # the eos that ended generation is not text
        min_tokens = self._min_tokens
        if before < min_tokens <= self.tokens:  # this chunk holds the min_tokens-th token: where stops may end
            self._text += self._detok.add(ids[:min_tokens - before])
            self._floor, ids = len(self._text), ids[min_tokens - before:]
        self._text += self._detok.add(ids)
        if self.tokens <= min_tokens:
            self._floor = len(self._text)
        hit = _find_stop(self._text, self._stops, max(0, self._scanned - self._hold), self._floor)
        self._scanned = len(self._text)
        stop = None
        if hit is not None:
            stop, cut = hit
            self._text, finish = self._text[:cut], "stop"
        end = len(self._text) if finish else max(self._sent, len(self._text) - self._hold)
        delta, self._sent = self._text[self._sent:end], end
        self.done = finish is not None
        return delta, finish, stop


async def run_job(backend: TokenBackend, tokenizer: Any, job: Job) -> AsyncIterator[Delta]:
    """The one generation path: backend chunks -> text deltas, stop strings applied, per choice
    (`n`); the last delta has `usage`."""
    gen = backend.generate(job.request_id, job.prompt_ids, job.sampling, arrival_ns=job.arrival_ns,
                           traceparent=job.traceparent)
    choices = [_ChoiceText(tokenizer, job.stops, job.sampling.min_tokens) for _ in range(job.sampling.n)]
    # The prompt's logprobs come with the backend's last chunk: a stop string does not end the wait for it.
    wait_for_last = job.sampling.prompt_logprobs is not None
    last: GenerationChunk | None = None
    final: Delta | None = None  # the last delta, once every choice has ended
    try:
        async for chunk in gen:
            if last is not None and last.finish_reason is not None:
                break  # by contract nothing follows the finish chunk
            last, ids = chunk, chunk.new_token_ids
            ends = chunk.choice_finish or chunk.finish_reason
            if ends in ("error", "abort"):  # a choice of n failed (a single one's failure is the backend's error)
                raise BackendError(f"choice {chunk.index} of {job.sampling.n} ended with {ends!r}", 502)
            choice = choices[chunk.index]
            if final is not None or choice.done:  # ended by a stop string: the rest of its tokens are not its
                if final is not None and chunk.finish_reason is not None:
                    final = dataclasses.replace(final, prompt_logprobs=chunk.prompt_logprobs)
                continue
            if not ids and ends is None:
                continue
            text, finish, stop = choice.take(ids, ends)
            delta = Delta(text, finish, token_ids=chunk.new_token_ids, logprobs=chunk.logprobs,
                          stop_reason=stop if stop is not None else chunk.stop_reason if finish else None,
                          index=chunk.index)
            if not all(c.done for c in choices):
                yield delta
                continue
            final = dataclasses.replace(delta, usage=_usage(job, sum(c.tokens for c in choices), last),
                                        prompt_logprobs=chunk.prompt_logprobs)
            if chunk.finish_reason is None and not wait_for_last:
                break  # a stop string: stop consuming; the finally closes gen so the backend aborts
        if final is None or wait_for_last and last.finish_reason is None:
            raise BackendError("the backend ended the generation without a finish_reason")
        yield final
    finally:
        await aclose(gen)


def envelope(job: Job, choices: list[dict[str, Any]], usage: Usage | None, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
    body: dict[str, Any] = {"id": job.request_id, "object": kind, "created": job.created, "model": job.model,
                            "choices": choices}
    if not chunk or job.include_usage:  # OpenAI: with include_usage every chunk has "usage" (null but the last)
        body["usage"] = usage.model_dump(exclude={"completion_tokens_details"}
                                          if usage.completion_tokens_details is None else None) if usage else None
    return body


def with_reasoning_tokens(usage: Usage, parsing: RequestParsers, generated: dict[int, list[int]]) -> Usage:
    """`usage` with vLLM's completion_tokens_details when the model has a reasoning parser:
    the choices' reasoning tokens (`generated`: each choice's token ids)."""
    counts = [parsing.reasoning_tokens(index, ids) for index, ids in generated.items()]
    if None in counts:
        return usage
    return usage.model_copy(update={"completion_tokens_details": {"reasoning_tokens": sum(counts)}})


def sse_event(body: dict[str, Any]) -> str:
    # ASCII only: a raw U+2028 or U+0085 in the text ends a line for clients that split on
    # every Unicode line break (httpx's iter_lines, so the openai SDK), cutting the JSON in two.
    return f"data: {json.dumps(body)}\n\n"


async def sse(job: Job, first: Delta, rest: AsyncIterator[Delta],
              logprobs_of: Callable[[Job, list[TokenLogprobs], list[int]], dict | None]) -> AsyncIterator[str]:
    """OpenAI's SSE stream: chunks, an optional usage chunk, then [DONE]; `logprobs_of` shapes
    a chunk's logprobs (after the ids its choice generated before them)."""
    generated: dict[int, list[int]] = {i: [] for i in range(job.sampling.n)}
    echoed: set[int] = set()  # the choices whose text has begun with the prompt's (echo)

    parsing = job.parsing

    def chunk(delta: Delta, role: bool = False) -> str:
        """The delta's event; "" when a parser holds its text back and nothing else is new."""
        if job.echo is not None and delta.index not in echoed:
            echoed.add(delta.index)
            delta = dataclasses.replace(delta, text=job.echo + delta.text)
        logprobs = None if role else logprobs_of(job, list(delta.logprobs), generated[delta.index])
        generated[delta.index].extend(delta.token_ids)
        finish, token_ids = delta.finish_reason, job.return_token_ids
        if parsing is not None and not role:  # as vLLM's stream generator with a parser
            msg = parsing.delta(delta.index, delta.text, delta.token_ids, finish is not None)
            if parsing.hide_metadata:
                logprobs, token_ids = None, False
            if msg is None and finish is None and logprobs is None and not token_ids:
                return ""
            msg, finish = msg or {}, finish and parsing.finish(delta.index, finish)
            choice = {"index": delta.index, "delta": msg}
        elif job.chat:
            msg = ({"role": "assistant"} if role else {}) | ({"content": delta.text} if delta.text or role else {})
            choice = {"index": delta.index, "delta": msg}
        else:
            choice = {"index": delta.index, "text": delta.text}
        choice |= {"logprobs": logprobs, "finish_reason": finish, "stop_reason": delta.stop_reason}
        if token_ids:
            choice["token_ids"] = delta.token_ids
        return sse_event(envelope(job, [choice], None, chunk=True))

    try:
        if job.chat:  # the role comes first, as OpenAI sends it: each choice's
            for index in range(job.sampling.n):
                yield chunk(Delta("", index=index), role=True)
        last = first
        if event := chunk(first):
            yield event
        if first.usage is None:  # the request's last delta has it
            async for last in rest:
                if event := chunk(last):
                    yield event
        if job.include_usage:
            usage = last.usage if parsing is None else with_reasoning_tokens(last.usage, parsing, generated)
            yield sse_event(envelope(job, [], usage, chunk=True))
    except BackendError as e:  # headers are sent: the error becomes an event
        yield sse_event(error_body(str(e), e.kind))
    except Exception as e:
        log.exception("stream failed")
        yield sse_event(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
    finally:
        await aclose(rest)
    yield "data: [DONE]\n\n"
