"""OpenAI-compatible HTTP front end (an `HttpApp`, http_app.py) over a `TokenBackend`.

The router owns the tokenizer: prompts are tokenized and validated here, the
backend sees only token ids, and generated ids are detokenized here. Stop
strings are matched on the detokenized text, so they are handled here too.

Beyond OpenAI's fields, `usage.pd` reports the P/D cache and transfer counts:
`{"p_cached_tokens", "d_cached_tokens", "transferred_tokens"}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError
from tokenizers.decoders import DecodeStream

from pdcluster.cluster.messages import SamplingSpec
from pdcluster.router.backend import BackendError, GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.http_app import (
    HttpApp,
    HttpRequest,
    Response,
    StreamResponse,
    aclose,
    error_body,
    json_response,
)

log = logging.getLogger(__name__)

class StreamOptions(BaseModel):
    include_usage: bool = False


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extension: the choice also carries prompt_token_ids and the generated token_ids.
    return_token_ids: bool | None = None


class CompletionRequest(_CommonRequest):
    # Strict types: lax pydantic would turn `true` or "5" into token ids.
    prompt: StrictStr | list[StrictInt] | list[StrictStr | list[StrictInt]]
    echo: bool | None = None
    logprobs: int | None = None


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class PdUsage(BaseModel):
    p_cached_tokens: int
    d_cached_tokens: int
    transferred_tokens: int
    transfer_error: str | None = None  # set when the KV pull failed and D recomputed the prompt


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    pd: PdUsage


class ApiError(Exception):
    """A request the client got wrong; becomes an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


M = TypeVar("M", bound=BaseModel)


def _parse(request: HttpRequest, model: type[M]) -> M:
    # Every malformed request is a 400 with an OpenAI body naming the field.
    try:
        obj = json.loads(request.body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            raise ApiError(f"'{where}' is a required field", param=param) from None
        if param == "prompt":  # the union's own messages would list every member
            raise ApiError("'prompt' must be a string, a list of token ids (ints), "
                           "or a list holding one of those", param=param) from None
        raise ApiError(f"invalid '{where}': {err['msg']}", param=param) from None


@dataclass(frozen=True)
class _Job:
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
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class _Delta:
    """New text for the client; the last one has `finish_reason` and `usage`."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    token_ids: list[int] = field(default_factory=list)  # generated ids this delta covers


class _Detokenizer:
    """Text for generated ids as they come, a step per id (tokenizers' DecodeStream, as
    vLLM v1's FastIncrementalDetokenizer): re-decoding every id so far for each delta cost
    O(n) a delta, 96 ms of router CPU for a 1,024-token answer sent a token at a time.

    A UTF-8 character split across tokens comes out with the token that completes it. At
    the end, ids that never completed one are decoded as they are (U+FFFD), as a whole
    decode would show them.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer the stream steps
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []  # ids whose text has not come out yet

    def add(self, ids: list[int], final: bool = False) -> str:
        pieces = []
        for token_id in ids:
            piece = self._step(token_id)
            if piece is None:
                self._held.append(token_id)
            else:
                self._held.clear()
                pieces.append(piece)
        if final and self._held:
            pieces.append(self._tokenizer.decode(self._held, skip_special_tokens=True))
            self._held.clear()
        return "".join(pieces)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as err:
            # tokenizers can fail a step when a decode is not an extension of the previous
            # one (vLLM issue 17448); vLLM starts a new stream then, and so do we.
            if "Invalid prefix" not in str(err):
                raise
        self._stream = DecodeStream(skip_special_tokens=True)
        return self._stream.step(self._backend, token_id)


INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized in worker threads (~2K tokens: ~2 ms here)
# One 128K-token prompt is ~0.3 s of one core: at C90's 6 req/s one thread would be ~2/3 busy,
# and a burst would queue behind it. Threads run their encodes in parallel (no GIL held).
TOKENIZE_THREADS = max(1, min(4, os.cpu_count() or 1))


class _PromptTokenizer:
    """Prompts to token ids, off the event loop when they are long.

    A 128K-token text prompt takes the Rust tokenizer ~300 ms here; on the event loop,
    every other request (streams included) would wait that long. Long prompts go to a few
    worker threads instead, where `encode_batch` runs without the GIL (a single `encode`
    holds it), so several long prompts are tokenized on several cores at once, as vLLM's
    API server tokenizes in a thread pool. Short ones stay inline: a thread handoff costs
    more than their encode.

    Both paths call the Rust tokenizer directly (HF's wrapper took ~9 of ~20 us a short
    prompt) with special tokens added, as `tokenizer.encode` does. One HF encode at start
    leaves truncation, padding and special-token splitting as HF's calls set them, so no
    later HF call changes the Rust tokenizer while the worker reads it (tokenizers fails
    such a call with "Already borrowed").
    """

    def __init__(self, tokenizer: Any, threads: int | None = None):
        tokenizer.encode("")
        self._tokenizer, self._backend = tokenizer, tokenizer.backend_tokenizer
        self._workers = ThreadPoolExecutor(threads or TOKENIZE_THREADS, thread_name_prefix="tokenize")

    async def text(self, text: str) -> list[int]:
        return await self._run(len(text), partial(self._encode, text))

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(await self._run(sum(len(m["content"]) for m in messages),
                                    partial(self._tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)))

    async def _run(self, chars: int, tokenize: Callable[[], list[int]]) -> list[int]:
        if chars <= INLINE_TOKENIZE_CHARS:
            return tokenize()
        return await asyncio.get_running_loop().run_in_executor(self._workers, tokenize)

    def _encode(self, text: str) -> list[int]:
        return self._backend.encode_batch([text])[0].ids


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _usage(job: _Job, completion_tokens: int, last: GenerationChunk | None) -> Usage:
    last = last or GenerationChunk([])
    return Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=completion_tokens,
                 total_tokens=len(job.prompt_ids) + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=last.p_cached_tokens),
                 pd=PdUsage(p_cached_tokens=last.p_cached_tokens, d_cached_tokens=last.d_cached_tokens,
                            transferred_tokens=last.transferred_tokens, transfer_error=last.transfer_error))


async def _run(backend: TokenBackend, tokenizer: Any, job: _Job) -> AsyncIterator[_Delta]:
    """The one generation path: backend chunks -> text deltas, stop strings applied."""
    gen = backend.generate(job.request_id, job.prompt_ids, job.sampling, arrival_ns=job.arrival_ns)
    detok = _Detokenizer(tokenizer)
    # Streamed text keeps the last len(longest stop)-1 characters back, so a
    # stop string split across tokens never reaches the client.
    hold = max((len(s) for s in job.stops), default=1) - 1
    text, sent, scanned, n_out = "", 0, 0, 0
    last: GenerationChunk | None = None
    final: _Delta | None = None
    try:
        async for chunk in gen:
            if final is not None:
                break  # by contract nothing follows the finish chunk
            last, ids, finish = chunk, chunk.new_token_ids, chunk.finish_reason
            if not ids and finish is None:
                continue
            n_out += len(ids)
            if finish == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
                ids = ids[:-1]  # the eos that ended generation is not text
            text += detok.add(ids, final=finish is not None)
            cut = _find_stop(text, job.stops, max(0, scanned - hold))
            scanned = len(text)
            if cut is not None:
                text, finish = text[:cut], "stop"
            end = len(text) if finish else max(sent, len(text) - hold)
            delta, sent = text[sent:end], end
            if finish is None:
                yield _Delta(delta, token_ids=chunk.new_token_ids)
                continue
            final = _Delta(delta, finish, _usage(job, n_out, last), token_ids=chunk.new_token_ids)
            if cut is not None:
                break  # a stop string: stop consuming; the finally closes gen so the backend aborts
        if final is None:
            raise BackendError("the backend ended the generation without a finish_reason")
        yield final
    finally:
        await aclose(gen)


def build_app(backend: TokenBackend, tokenizer_dir: str) -> HttpApp:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # _Detokenizer steps the Rust tokenizer
        raise ValueError(f"{tokenizer_dir}: the router needs a fast tokenizer (tokenizer.json); "
                         f"transformers loaded a {type(tokenizer).__name__}")
    prompts = _PromptTokenizer(tokenizer)
    app = HttpApp()

    def make_job(req: _CommonRequest, chat: bool, prompt_ids: list[int], max_tokens: int | None,
                 max_tokens_param: str, arrival_ns: int, client_id: str | None = None) -> _Job:
        card: ModelCard = backend.model_card()
        if client_id is not None and not (0 < len(client_id) <= 128 and client_id.isprintable()):
            raise ApiError("the X-Request-Id header must be 1 to 128 printable characters")
        what = "messages" if chat else "prompt"
        if req.n not in (None, 1):
            raise ApiError(f"n must be 1 (got {req.n}): only one choice per request is supported", param="n")
        if not prompt_ids:
            raise ApiError(f"the {what} is empty", param=what)
        if not (0 <= min(prompt_ids) and max(prompt_ids) < card.vocab_size):  # C-speed scans: 128K ids in 2.5 ms
            i, t = next((i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < card.vocab_size)
            raise ApiError(f"token id {t} at index {i} of the {what} is out of range "
                           f"[0, {card.vocab_size})", param=what)
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
        if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
            max_tokens = max(1, card.max_model_len - len(prompt_ids)) if chat else 16
        if len(prompt_ids) + max_tokens > card.max_model_len:
            raise ApiError(f"This model's maximum context length is {card.max_model_len} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {what}, "
                           f"{max_tokens} for the completion). Please reduce the length of the {what} or completion.")
        temperature = 1.0 if req.temperature is None else req.temperature
        if not temperature >= 0:  # written so that NaN fails too
            raise ApiError(f"temperature must be >= 0, got {temperature}", param="temperature")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 < top_p <= 1:
            raise ApiError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = 0 if req.top_k in (None, -1) else req.top_k  # vLLM's -1 is our 0: off
        if top_k < 0:
            raise ApiError(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
        stops = tuple(s for s in ((req.stop,) if isinstance(req.stop, str) else req.stop or ()) if s)
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=req.seed, ignore_eos=bool(req.ignore_eos),
                                stop_token_ids=tuple(req.stop_token_ids or ()),
                                final_only=not req.stream and not stops)  # stop strings are matched here, as tokens come
        prefix = "chatcmpl-" if chat else "cmpl-"
        # As vLLM's server: the client may name the request (X-Request-Id); ids need not be unique.
        return _Job(request_id=prefix + (client_id or uuid.uuid4().hex), chat=chat, model=card.name, prompt_ids=prompt_ids,
                    sampling=sampling, stops=stops, stream=bool(req.stream),
                    include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
                    return_token_ids=bool(req.return_token_ids), arrival_ns=arrival_ns)

    def check_model(req: _CommonRequest) -> None:
        name = backend.model_card().name
        if req.model is not None and req.model != name:
            raise ApiError(f"The model `{req.model}` does not exist; this server serves `{name}`",
                           status=404, param="model")

    async def serve(job: _Job) -> Response:
        deltas = _run(backend, tokenizer, job)
        if not job.stream:
            try:
                pieces = [d async for d in deltas]
            finally:
                await aclose(deltas)
            last = pieces[-1]
            text = "".join(d.text for d in pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if job.chat
                      else {"index": 0, "text": text})
            choice |= {"logprobs": None, "finish_reason": last.finish_reason}
            if job.return_token_ids:
                choice |= {"prompt_token_ids": job.prompt_ids, "token_ids": [t for d in pieces for t in d.token_ids]}
            return json_response(_envelope(job, [choice], last.usage, chunk=False))
        # The first delta is awaited before the response starts, so errors the
        # backend raises up front (overload, bad request) keep their HTTP status.
        try:
            first = await deltas.__anext__()
        except BaseException:
            await aclose(deltas)
            raise
        return StreamResponse(_sse(job, first, deltas), headers={"cache-control": "no-cache"})

    async def guarded(handler: Any) -> Response:
        try:
            return await handler
        except ApiError as e:
            return json_response(error_body(str(e), e.kind, e.param), e.status)
        except BackendError as e:
            return json_response(error_body(str(e), e.kind), e.status)
        except Exception as e:  # a bug or a broken backend: answer, never hang
            log.exception("request failed")
            return json_response(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    async def completions(request: HttpRequest) -> Response:
        arrival_ns = time.monotonic_ns()
        req = _parse(request, CompletionRequest)
        check_model(req)
        if req.echo:
            raise ApiError("echo is not supported", param="echo")
        if req.logprobs is not None:
            raise ApiError("logprobs is not supported", param="logprobs")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(f"batches of prompts are not supported (got {len(prompt)}); "
                               "send one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = await prompts.text(prompt) if isinstance(prompt, str) else list(prompt)
        return await serve(make_job(req, False, ids, req.max_tokens, "max_tokens", arrival_ns,
                                    request.headers.get("x-request-id")))

    async def chat_completions(request: HttpRequest) -> Response:
        arrival_ns = time.monotonic_ns()
        req = _parse(request, ChatCompletionRequest)
        check_model(req)
        if req.logprobs:
            raise ApiError("logprobs is not supported", param="logprobs")
        if not req.messages:
            raise ApiError("messages is empty", param="messages")
        try:
            ids = await prompts.chat([m.model_dump() for m in req.messages])
        except Exception as e:  # the template rejected the conversation (e.g. a role it does not know)
            raise ApiError(f"cannot apply the chat template to messages: {e}", param="messages") from None
        max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
        return await serve(make_job(req, True, ids, max_tokens, param, arrival_ns,
                                    request.headers.get("x-request-id")))

    async def models(request: HttpRequest) -> Response:
        card = backend.model_card()
        return json_response({"object": "list", "data": [{"id": card.name, "object": "model", "created": 0,
                                                          "owned_by": "pdcluster", "max_model_len": card.max_model_len,
                                                          "vocab_size": card.vocab_size}]})

    async def health(request: HttpRequest) -> Response:
        try:
            instances = await backend.health()
        except Exception as e:
            return json_response({"status": "error", "instances": {}, "error": str(e)}, 503)
        ok = all(instances.values())
        return json_response({"status": "ok" if ok else "unhealthy", "instances": instances}, 200 if ok else 503)

    app.add("POST", "/v1/completions", lambda request: guarded(completions(request)))
    app.add("POST", "/v1/chat/completions", lambda request: guarded(chat_completions(request)))
    app.add("GET", "/v1/models", models)
    app.add("GET", "/health", health)
    return app


def _envelope(job: _Job, choices: list[dict[str, Any]], usage: Usage | None, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
    body: dict[str, Any] = {"id": job.request_id, "object": kind, "created": job.created, "model": job.model,
                            "choices": choices}
    if not chunk or job.include_usage:  # OpenAI: with include_usage every chunk has "usage" (null but the last)
        body["usage"] = usage.model_dump() if usage else None
    return body


def _event(body: dict[str, Any]) -> str:
    # ASCII only: a raw U+2028 or U+0085 in the text ends a line for clients that split on
    # every Unicode line break (httpx's iter_lines, so the openai SDK), cutting the JSON in two.
    return f"data: {json.dumps(body)}\n\n"


async def _sse(job: _Job, first: _Delta, rest: AsyncIterator[_Delta]) -> AsyncIterator[str]:
    """OpenAI's SSE stream: chunks, an optional usage chunk, then [DONE]."""

    def chunk(delta: _Delta, role: bool = False) -> str:
        if job.chat:
            msg = ({"role": "assistant"} if role else {}) | ({"content": delta.text} if delta.text or role else {})
            choice = {"index": 0, "delta": msg}
        else:
            choice = {"index": 0, "text": delta.text}
        choice |= {"logprobs": None, "finish_reason": delta.finish_reason}
        if job.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return _event(_envelope(job, [choice], None, chunk=True))

    try:
        if job.chat:
            yield chunk(_Delta(""), role=True)  # the role comes first, as OpenAI sends it
        last = first
        yield chunk(first)
        if first.finish_reason is None:
            async for last in rest:
                yield chunk(last)
        if job.include_usage:
            yield _event(_envelope(job, [], last.usage, chunk=True))
    except BackendError as e:  # headers are sent: the error becomes an event
        yield _event(error_body(str(e), e.kind))
    except Exception as e:
        log.exception("stream failed")
        yield _event(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"))
    finally:
        await aclose(rest)
    yield "data: [DONE]\n\n"
