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


async def run_job(backend: TokenBackend, tokenizer: Any, job: Job) -> AsyncIterator[Delta]:
    """The one generation path: backend chunks -> text deltas, stop strings applied."""
    gen = backend.generate(job.request_id, job.prompt_ids, job.sampling, arrival_ns=job.arrival_ns,
                           traceparent=job.traceparent)
    detok = Detokenizer(tokenizer)
    # Streamed text keeps the last len(longest stop)-1 characters back, so a
    # stop string split across tokens never reaches the client.
    hold = max((len(s) for s in job.stops), default=1) - 1
    text, sent, scanned, n_out = "", 0, 0, 0
    min_tokens = job.sampling.min_tokens
    floor = 0  # stop strings end past the text of the first min_tokens tokens (once it is known)
    last: GenerationChunk | None = None
    final: Delta | None = None
    try:
        async for chunk in gen:
            if final is not None:
                break  # by contract nothing follows the finish chunk
            last, ids, finish = chunk, chunk.new_token_ids, chunk.finish_reason
            if not ids and finish is None:
                continue
            before, n_out = n_out, n_out + len(ids)
            if finish == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
                ids = ids[:-1]  # the eos that ended generation is not text
            if before < min_tokens <= n_out:  # this chunk holds the min_tokens-th token: where stops may end
                text += detok.add(ids[:min_tokens - before])
                floor, ids = len(text), ids[min_tokens - before:]
            text += detok.add(ids)
            if n_out <= min_tokens:
                floor = len(text)
            hit = _find_stop(text, job.stops, max(0, scanned - hold), floor)
            scanned = len(text)
            cut = None
            if hit is not None:
                text_stop, cut = hit
                text, finish = text[:cut], "stop"
            end = len(text) if finish else max(sent, len(text) - hold)
            delta, sent = text[sent:end], end
            if finish is None:
                yield Delta(delta, token_ids=chunk.new_token_ids, logprobs=chunk.logprobs)
                continue
            final = Delta(delta, finish, _usage(job, n_out, last), token_ids=chunk.new_token_ids,
                          logprobs=chunk.logprobs, prompt_logprobs=chunk.prompt_logprobs,
                          stop_reason=text_stop if cut is not None else chunk.stop_reason)
            if cut is not None:
                break  # a stop string: stop consuming; the finally closes gen so the backend aborts
        if final is None:
            raise BackendError("the backend ended the generation without a finish_reason")
        yield final
    finally:
        await aclose(gen)


def envelope(job: Job, choices: list[dict[str, Any]], usage: Usage | None, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
    body: dict[str, Any] = {"id": job.request_id, "object": kind, "created": job.created, "model": job.model,
                            "choices": choices}
    if not chunk or job.include_usage:  # OpenAI: with include_usage every chunk has "usage" (null but the last)
        body["usage"] = usage.model_dump() if usage else None
    return body


def sse_event(body: dict[str, Any]) -> str:
    # ASCII only: a raw U+2028 or U+0085 in the text ends a line for clients that split on
    # every Unicode line break (httpx's iter_lines, so the openai SDK), cutting the JSON in two.
    return f"data: {json.dumps(body)}\n\n"


async def sse(job: Job, first: Delta, rest: AsyncIterator[Delta],
              logprobs_of: Callable[[Job, list[TokenLogprobs], list[int]], dict | None]) -> AsyncIterator[str]:
    """OpenAI's SSE stream: chunks, an optional usage chunk, then [DONE]; `logprobs_of` shapes
    a chunk's logprobs (after the ids generated before them)."""
    generated: list[int] = []

    def chunk(delta: Delta, role: bool = False) -> str:
        if job.chat:
            msg = ({"role": "assistant"} if role else {}) | ({"content": delta.text} if delta.text or role else {})
            choice = {"index": 0, "delta": msg}
        else:
            choice = {"index": 0, "text": delta.text}
        choice |= {"logprobs": None if role else logprobs_of(job, list(delta.logprobs), generated),
                   "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        generated.extend(delta.token_ids)
        if job.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return sse_event(envelope(job, [choice], None, chunk=True))

    try:
        if job.chat:
            yield chunk(Delta(""), role=True)  # the role comes first, as OpenAI sends it
        last = first
        yield chunk(first if job.echo is None else dataclasses.replace(first, text=job.echo + first.text))
        if first.finish_reason is None:
            async for last in rest:
                yield chunk(last)
        if job.include_usage:
            yield sse_event(envelope(job, [], last.usage, chunk=True))
    except BackendError as e:  # headers are sent: the error becomes an event
        yield sse_event(error_body(str(e), e.kind))
    except Exception as e:
        log.exception("stream failed")
        yield sse_event(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
    finally:
        await aclose(rest)
    yield "data: [DONE]\n\n"
