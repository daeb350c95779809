"""OpenAI-compatible HTTP front end (an `HttpApp`, http_app.py) over a `TokenBackend`.

The router owns the tokenizer: prompts are tokenized and validated here, the
backend sees only token ids, and generated ids are detokenized here. Stop
strings are matched on the detokenized text, so they are handled here too.

Beyond OpenAI's fields, `usage.pd` reports the P/D cache and transfer counts:
`{"p_cached_tokens", "d_cached_tokens", "transferred_tokens", "transfer_error", "prefill_instance",
"local_prefill"}` (the last two: where the prompt was prefilled, a P or the D itself).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import msgspec

from pdcluster.proto.handle import MAX_RETENTION_S
from pdcluster.proto.messages import SamplingSpec, TokenLogprobs
from pdcluster.proto.router_spec import HttpLimits
from pdcluster.router.backend import BackendError, ModelCard, TokenBackend
from pdcluster.router.chat_content import content_format, developer_as_system, template_messages
from pdcluster.router.chat_parsers import ChatParsers
from pdcluster.router.chat_template import template_kwargs
from pdcluster.router.generation_defaults import default_max_tokens, with_defaults
from pdcluster.router.http_app import (
    BytesResponse,
    HttpApp,
    HttpRequest,
    Response,
    StreamResponse,
    aclose,
    error_body,
    json_response,
)
from pdcluster.router.logprobs import (
    TokenTexts,
    chat_logprobs,
    chat_logprobs_asked,
    check_logprobs,
    check_prompt_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from pdcluster.router.openai_models import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ApiError,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    DetokenizeRequest,
    M,
    TokenizeRequest,
    parse_body,
    refuse_unsupported,
)
from pdcluster.router.openai_stream import Delta, Job, envelope, run_job, sse, with_reasoning_tokens
from pdcluster.router.otlp import valid_traceparent
from pdcluster.router.sampling_checks import extra_sampling
from pdcluster.router.structured_outputs import GUIDED, structured_spec
from pdcluster.router.text_codec import PromptTokenizer
from pdcluster.router.tool_choice import checked_tools, template_tools
from pdcluster.router.vllm_params import refuse_vllm_only

log = logging.getLogger(__name__)
_encode_json = msgspec.json.Encoder().encode

MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: choices a request may ask for
# Decoding and validating a JSON body costs about what tokenizing an eighth of its bytes does
# (2.9 MB of chat messages: ~110 ms here): bodies past ~64 KB are parsed off the event loop.
PARSE_BYTES_PER_CHAR = 8


def load_tokenizer(tokenizer_dir: str):
    """The model's tokenizer as transformers loads it: a fast one (the Detokenizer steps the Rust
    tokenizer), or a ValueError naming what was loaded instead."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"{tokenizer_dir}: the router needs a fast tokenizer (tokenizer.json); "
                         f"transformers loaded a {type(tokenizer).__name__}")
    return tokenizer


def build_app(backend: TokenBackend, tokenizer, limits: HttpLimits = HttpLimits(),
              parsers: ChatParsers | None = None) -> HttpApp:
    """`tokenizer`: load_tokenizer's, or the directory to load it from; `parsers`: the model's tool
    and reasoning parsers, when the spec names any."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    tokenizer_dir = tokenizer.name_or_path  # as from_pretrained was given it
    prompts = PromptTokenizer(tokenizer)
    app = HttpApp(limits)
    texts = TokenTexts(tokenizer)

    def logprobs_of(job: Job, positions: Sequence[TokenLogprobs], context: Sequence[int] = (),
                    echoed: Sequence[TokenLogprobs | None] = (),
                    echoed_texts: Sequence[list[str] | None] = ()) -> dict | None:
        """The `logprobs` of generated `positions` (after `context`, the ids generated before them),
        behind an echoed prompt's (`echoed`, its first position None; `echoed_texts`: texts.of(echoed))."""
        top = job.sampling.logprobs
        if top is None:
            return None
        decoded = [*echoed_texts, *texts.of(positions, context)]  # each part in its own context, as vLLM's
        if job.chat:
            return chat_logprobs(positions, decoded, top)
        return completion_logprobs([*echoed, *positions], decoded, top, texts, token_ids=job.prompt_ids)

    def make_job(req: CommonRequest, chat: bool, prompt_ids: list[int], max_tokens: int | None,
                 max_tokens_param: str, arrival_ns: int, client_id: str | None = None,
                 traceparent: str | None = None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, echo: str | None = None) -> Job:
        card: ModelCard = backend.model_card()
        req = with_defaults(req, card.sampling_defaults)
        if client_id is not None and not (0 < len(client_id) <= 128 and client_id.isprintable()):
            raise ApiError("the X-Request-Id header must be 1 to 128 printable characters")
        what = "messages" if chat else "prompt"
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:  # vLLM's bounds and words (VLLM_MAX_N_SEQUENCES)
            raise ApiError(f"n must be at least 1, got {n}." if n < 1 else f"n must be at most {MAX_N}, got {n}.",
                           param="n")
        if n > 1 and not card.logits:
            raise ApiError("n > 1: the simulated engine samples one sequence a request", param="n")
        if not prompt_ids:
            raise ApiError(f"the {what} is empty", param=what)
        if not (0 <= min(prompt_ids) and max(prompt_ids) < card.vocab_size):  # C-speed scans: 128K ids in 2.5 ms
            i, t = next((i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < card.vocab_size)
            raise ApiError(f"token id {t} at index {i} of the {what} is out of range "
                           f"[0, {card.vocab_size})", param=what)
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
        if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
            # (within the model's own cap, as vLLM's)
            max_tokens = max(1, min(card.max_model_len - len(prompt_ids),
                                    default_max_tokens(card.sampling_defaults) or card.max_model_len)) if chat else 16
        if len(prompt_ids) + max_tokens > card.max_model_len:
            raise ApiError(f"This model's maximum context length is {card.max_model_len} tokens. However, you "
                           f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {what}, "
                           f"{max_tokens} for the completion). Please reduce the length of the {what} or completion.")
        refuse_unsupported(req, chat)
        refuse_vllm_only(req, chat)
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0 <= temperature <= 2:  # OpenAI's range; written so that NaN fails too (1e400 parses as inf)
            raise ApiError(f"temperature must be in [0, 2], got {temperature}", param="temperature")
        if n > 1 and temperature < 1e-5:  # vLLM's greedy threshold (_SAMPLING_EPS) and words
            raise ApiError(f"n must be 1 when using greedy sampling, got {n}.", param="n")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 < top_p <= 1:
            raise ApiError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = 0 if req.top_k in (None, -1) else req.top_k  # vLLM's -1 is our 0: off
        if top_k < 0:
            raise ApiError(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
        if top_k >= card.vocab_size:  # every token: the same as off (and no int too big for the wire)
            top_k = 0
        if req.seed is not None and not -2**63 <= req.seed < 2**63:  # vLLM's range (torch's manual_seed)
            raise ApiError(f"seed must be a 64-bit signed integer, got {str(req.seed)[:40]}", param="seed")
        for t in req.stop_token_ids or ():
            if not 0 <= t < card.vocab_size:
                raise ApiError(f"stop_token_ids: token id {t} is out of range [0, {card.vocab_size})",
                               param="stop_token_ids")
        stops = tuple(s for s in ((req.stop,) if isinstance(req.stop, str) else req.stop or ()) if s)
        if len(stops) > MAX_STOP_STRINGS or sum(map(len, stops)) > MAX_STOP_CHARS:
            # Every delta is searched for every stop string: a long list costs the router's loop.
            raise ApiError(f"stop: at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all, "
                           f"got {len(stops)} of {sum(map(len, stops))}", param="stop")
        retain_s = 0.0 if req.kv_retention_s is None else req.kv_retention_s
        if not 0 <= retain_s <= MAX_RETENTION_S:
            raise ApiError(f"kv_retention_s must be in [0, {MAX_RETENTION_S:g}] seconds, got {retain_s}",
                           param="kv_retention_s")
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=req.seed, ignore_eos=bool(req.ignore_eos),
                                stop_token_ids=tuple(req.stop_token_ids or ()),
                                final_only=not req.stream and not stops,  # stop strings are matched here, as tokens come
                                retain_s=retain_s, logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=n,
                                structured=structured_spec(req.structured_outputs, req.response_format, card.logits, {
                                    k: v for k in GUIDED if (v := getattr(req, k)) is not None}),
                                **extra_sampling(req, card.vocab_size, max_tokens, tokenizer))
        prefix = "chatcmpl-" if chat else "cmpl-"
        # As vLLM's server: the client may name the request (X-Request-Id); ids need not be unique.
        return Job(request_id=prefix + (client_id or uuid.uuid4().hex), chat=chat, model=card.name, prompt_ids=prompt_ids,
                    sampling=sampling, stops=stops, stream=bool(req.stream),
                    include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
                    return_token_ids=bool(req.return_token_ids), arrival_ns=arrival_ns, traceparent=traceparent,
                    echo=echo)

    def check_model(req: CommonRequest | TokenizeRequest | DetokenizeRequest) -> None:
        name = backend.model_card().name
        if req.model is not None and req.model != name:
            raise ApiError(f"The model `{req.model}` does not exist; this server serves `{name}`",
                           status=404, param="model")

    async def serve(job: Job) -> Response:
        deltas = run_job(backend, tokenizer, job)
        if not job.stream:
            try:
                pieces = [d async for d in deltas]
            finally:
                await aclose(deltas)
            last = pieces[-1]
            # The prompt's logprobs' texts, once for all n choices (a long prompt's are the costly part).
            prompt_texts = texts.of(last.prompt_logprobs)
            shown = None if job.sampling.prompt_logprobs is None else prompt_logprobs(last.prompt_logprobs,
                                                                                      prompt_texts)
            per_choice = [[d for d in pieces if d.index == index] for index in range(job.sampling.n)]
            choices = [answer_choice(job, index, mine, last, prompt_texts, shown) for index, mine in enumerate(per_choice)]
            usage = last.usage if job.parsing is None else with_reasoning_tokens(
                last.usage, job.parsing, {i: [t for d in mine for t in d.token_ids] for i, mine in enumerate(per_choice)})
            body = envelope(job, choices, usage, chunk=False)
            if shown is not None and job.chat:  # vLLM's place for them on chat
                body["prompt_logprobs"] = shown
            return json_response(body)
        # The first delta is awaited before the response starts, so errors the
        # backend raises up front (overload, bad request) keep their HTTP status.
        try:
            first = await deltas.__anext__()
        except BaseException:
            await aclose(deltas)
            raise
        return StreamResponse(sse(job, first, deltas, logprobs_of), headers={"cache-control": "no-cache"})

    def answer_choice(job: Job, index: int, pieces: list[Delta], last: Delta, prompt_texts: list[list[str] | None],
                      shown_prompt_logprobs: list | None) -> dict[str, Any]:
        """Choice `index` of an unstreamed answer, from its deltas (`last`: the request's last;
        the prompt's logprobs' texts and shape, worked out once for all choices)."""
        end = next(d for d in reversed(pieces) if d.finish_reason is not None)
        text = (job.echo or "") + "".join(d.text for d in pieces)
        token_ids = [t for d in pieces for t in d.token_ids]
        finish, hide = end.finish_reason, job.parsing is not None and job.parsing.hide_metadata
        if job.parsing is not None:  # the model's parsers split reasoning and tool calls off the text
            message, finish = job.parsing.message(index, text, token_ids, finish)
            choice = {"index": index, "message": message}
        else:
            choice = ({"index": index, "message": {"role": "assistant", "content": text}} if job.chat
                      else {"index": index, "text": text})
        # As vLLM: with echo, the prompt's tokens and logprobs, then the answer's.
        echo = job.echo is not None
        choice |= {"logprobs": None if hide else logprobs_of(job, [p for d in pieces for p in d.logprobs],
                                                             echoed=last.prompt_logprobs if echo else (),
                                                             echoed_texts=prompt_texts if echo else ()),
                   "finish_reason": finish, "stop_reason": end.stop_reason}
        if job.return_token_ids and not hide:
            choice |= {"prompt_token_ids": job.prompt_ids, "token_ids": token_ids}
        if shown_prompt_logprobs is not None and not job.chat:  # vLLM's place for them: each choice
            choice["prompt_logprobs"] = shown_prompt_logprobs
        return choice

    formats: dict[str, str] = {}  # the chat template's content format (chat_content.py), once a request needs it

    async def chat_ids(req: ChatCompletionRequest | TokenizeRequest, tools: list | None = None) -> list[int]:
        messages = req.messages
        kwargs = template_kwargs(tokenizer, req.chat_template_kwargs, req.add_generation_prompt,
                                 req.continue_final_message) | {"tools": tools}
        if "fmt" not in formats and any(not isinstance(m.content, str) for m in messages):
            # Off the loop: vLLM's template reader, in a child process (seconds, once).
            formats["fmt"] = await prompts.run(1 << 30, partial(content_format, getattr(tokenizer, "chat_template", None)))
        converted = developer_as_system(template_messages(messages, formats.get("fmt", "string")),
                                        getattr(tokenizer, "chat_template", None))
        try:
            return await prompts.chat(converted, kwargs)
        except Exception as e:  # the template rejected the conversation (e.g. a role it does not know)
            raise ApiError(f"cannot apply the chat template to messages: {e}", param="messages") from None

    async def guarded(handler: Any) -> Response:
        try:
            return await handler
        except ApiError as e:
            return json_response(error_body(str(e), e.kind, e.param), e.status)
        except BackendError as e:
            retry = {"retry-after": str(e.retry_after_s)} if e.retry_after_s is not None else None
            return json_response(error_body(str(e), e.kind), e.status, headers=retry)
        except Exception as e:  # a bug or a broken backend: answer, never hang
            log.exception("request failed")
            return json_response(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    async def parse(request: HttpRequest, model: type[M]) -> M:
        # A body of megabytes takes tens of ms to decode and validate: off the loop, as prompts are.
        return await prompts.run(len(request.body) // PARSE_BYTES_PER_CHAR, partial(parse_body, request, model))

    async def completions(request: HttpRequest) -> Response:
        arrival_ns = time.monotonic_ns()
        req = await parse(request, CompletionRequest)
        check_model(req)
        backend.admit()  # a 429 before the prompt costs a tokenization
        card = backend.model_card()
        logprobs = check_logprobs(req.logprobs, "logprobs", card)
        asked_prompt_logprobs = check_prompt_logprobs(req.prompt_logprobs, bool(req.stream), card)
        if req.echo and asked_prompt_logprobs is None:
            if logprobs is not None and req.stream:
                raise ApiError("echo with logprobs is served unstreamed only (the prompt's logprobs come with "
                               "P's answer)", param="echo")
            asked_prompt_logprobs = logprobs  # vLLM's: the echoed prompt gets logprobs as the answer does
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(f"batches of prompts are not supported (got {len(prompt)}); "
                               "send one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = await prompts.text(prompt) if isinstance(prompt, str) else list(prompt)
        echo = None
        if req.echo:  # vLLM's: the prompt as given, or its ids decoded; none with return_token_ids
            echo = "" if req.return_token_ids else prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        return await serve(make_job(req, False, ids, req.max_tokens, "max_tokens", arrival_ns,
                                    request.headers.get("x-request-id"),
                                    valid_traceparent(request.headers.get("traceparent")), logprobs,
                                    asked_prompt_logprobs, echo))

    async def chat_completions(request: HttpRequest) -> Response:
        arrival_ns = time.monotonic_ns()
        req = await parse(request, ChatCompletionRequest)
        check_model(req)
        backend.admit()
        card = backend.model_card()
        logprobs = chat_logprobs_asked(req.logprobs, req.top_logprobs, card)
        asked_prompt_logprobs = check_prompt_logprobs(req.prompt_logprobs, bool(req.stream), card)
        if not req.messages:
            raise ApiError("messages is empty", param="messages")
        tools = checked_tools(req.tools, req.tool_choice, req.parallel_tool_calls, "tool_choice" in req.model_fields_set,
                              parsers is not None and parsers.tool_parser)
        ids = await chat_ids(req, tools)
        max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
        job = make_job(req, True, ids, max_tokens, param, arrival_ns, request.headers.get("x-request-id"),
                       valid_traceparent(request.headers.get("traceparent")), logprobs, asked_prompt_logprobs)
        if parsers is not None:  # vLLM's parsers' view of the request: a tool call's constraint, where reasoning ends
            kwargs = (req.chat_template_kwargs or {}) | {"add_generation_prompt": req.add_generation_prompt,
                                                         "continue_final_message": req.continue_final_message}
            parsing = await prompts.run(len(request.body) // PARSE_BYTES_PER_CHAR, partial(
                parsers.for_request, req.model_dump(exclude_unset=True), kwargs, ids, job.sampling.n,
                job.sampling.structured))
            if parsing is not None:
                job = dataclasses.replace(job, parsing=parsing, sampling=dataclasses.replace(
                    job.sampling, structured=parsing.structured, reasoning_ended=parsing.reasoning_ended))
        return await serve(job)

    async def models(request: HttpRequest) -> Response:
        card = backend.model_card()
        # root: where the tokenizer is, as vLLM reports its model's path (bench clients load it).
        return json_response({"object": "list", "data": [{"id": card.name, "object": "model", "created": 0,
                                                          "owned_by": "pdcluster", "root": tokenizer_dir,
                                                          "max_model_len": card.max_model_len,
                                                          "vocab_size": card.vocab_size}]})

    async def tokenize(request: HttpRequest) -> Response:
        req = await parse(request, TokenizeRequest)
        check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError("give one of 'prompt' or 'messages'", param="prompt")
        if req.prompt is not None:
            ids = await prompts.text(req.prompt)
        else:
            ids = await chat_ids(req, None if req.tools is None else template_tools(req.tools))
        card = backend.model_card()
        # msgspec: 630K ids in ~5 ms; json.dumps held the loop ~150 ms for them.
        return BytesResponse(_encode_json({"count": len(ids), "max_model_len": card.max_model_len, "tokens": ids,
                                           "token_strs": None}))

    async def detokenize(request: HttpRequest) -> Response:
        req = await parse(request, DetokenizeRequest)
        check_model(req)
        try:  # the ids' check and their decode run off the loop when long
            text = await prompts.decode(req.tokens, backend.model_card().vocab_size)
        except ValueError as e:
            raise ApiError(str(e), param="tokens") from None
        return json_response({"prompt": text})

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
    app.add("POST", "/tokenize", lambda request: guarded(tokenize(request)))
    app.add("POST", "/detokenize", lambda request: guarded(detokenize(request)))
    app.add("GET", "/health", health)
    return app
