"""The OpenAI API's request and response bodies, and how a request body is parsed.

Every malformed request becomes an `ApiError`: HTTP 400 (unless it says otherwise)
with an OpenAI-style body naming the field. The JSON must be strict JSON (no NaN or
Infinity), valid UTF-8, with no number a float or a 64-bit integer cannot hold (msgspec's
decoder, ~2.5x faster than json's: 0.33 vs 0.80 ms for a 16K-token prompt).

Parameters (docs/api.md): those in `CommonRequest` and the endpoint's model are
served; `UNSUPPORTED` lists the OpenAI parameters that would change the output and that the
router cannot honour: a request setting one to anything but its no-op value is refused
(400 naming it), never silently served without it; any other field is ignored, as vLLM does.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, TypeVar

import annotated_types
import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from pdcluster.router.http_app import HttpRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


# Every field a client can grow is bounded, and lists are counted before anything is validated
# (`_check_lengths`): 100,000 empty messages held a thread (and with it the GIL, so the event loop)
# for ~120 ms in pydantic before its 400. Stops are matched at every streamed delta and checked
# by both engines at every step: vLLM sets no bound; OpenAI takes 4 stop strings.
MAX_STOPS = 64
MAX_STOP_TOKEN_IDS = 1024
# D applies these at every step (vLLM sets no bound): a token's worth of bias, whitelist or ban
# each, bounded as generously as a client could mean them.
MAX_LOGIT_BIAS = 4096
MAX_ALLOWED_TOKEN_IDS = 1 << 17
MAX_BAD_WORDS = 128  # vLLM's own VLLM_MAX_NUM_BAD_WORDS default


class CommonRequest(BaseModel):
    # Unknown fields are kept aside (model_extra): vLLM's own ones are refused unless at their
    # defaults (router/vllm_params.py), any other is ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extension: the choice also carries prompt_token_ids and the generated token_ids.
    return_token_ids: bool | None = None
    # pdcluster's: keep this prompt's blocks in the instances' host KV tiers ahead of others for so
    # many seconds (a session's next turn expected within it); docs/kv_tiers.md "Retention".
    kv_retention_s: float | None = None
    # Sampling on D beyond the plain parameters, with vLLM's meaning (router/sampling_checks.py).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: StrictInt | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    # Computed by whoever prefills the prompt (router/logprobs.py); 0 is each prompt token's own.
    prompt_logprobs: StrictInt | None = None
    # Refused unless unset or at their no-op value (UNSUPPORTED); typed loosely so that the
    # refusal, not a type error, is what the client reads.
    # Structured outputs (router/structured_outputs.py reads them): typed loosely, checked there.
    response_format: Any = None
    structured_outputs: Any = None
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None


# Stop strings: OpenAI allows 4, vLLM any number; the router searches each delta's text for
# each one, so a list of thousands (a 140 KB list cost 3.5 s of the loop for one 3K-token
# answer) would stall every other request. These bounds keep that search to microseconds.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 2048

# OpenAI (and vLLM) parameters the router cannot honour, with the values that mean "off".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
}


def refuse_unsupported(req: CommonRequest, chat: bool) -> None:
    """UNSUPPORTED's parameters (and on completions COMPLETION_ONLY_OFF's) not at a no-op value: a 400."""
    for table in (UNSUPPORTED,) if chat else (UNSUPPORTED, COMPLETION_ONLY_OFF):
        for name, off in table.items():
            if (value := getattr(req, name)) is not None:  # None is every one's no-op: the common case, checked first
                refuse_unless_off(name, value, off)


def refuse_unless_off(name: str, value: Any, off: tuple[Any, ...]) -> None:
    """A 400 naming the parameter unless `value` is one of its no-op values `off`."""
    # Same type and value (True == 1, but true is not best_of 1).
    if not any(type(value) is type(o) and value == o for o in off):
        shown = f" (got {value!r:.60})" if isinstance(value, (int, float, str)) else ""
        raise ApiError(f"'{name}' is not supported by this server{shown}", param=name)


class CompletionRequest(CommonRequest):
    # Strict types: lax pydantic would turn `true` or "5" into token ids.
    prompt: StrictStr | list[StrictInt] | list[StrictStr | list[StrictInt]]
    echo: bool | None = None
    logprobs: StrictInt | None = None  # so many alternatives (router/logprobs.py)
    tools: Any = None  # chat's: refused here unless off (COMPLETION_ONLY_OFF)
    tool_choice: Any = None


# Chat's parameters a completion request cannot honour, and their no-op values.
COMPLETION_ONLY_OFF: dict[str, tuple[Any, ...]] = {"tools": (None, []), "tool_choice": (None, "none")}


MAX_MESSAGES = 4096  # a conversation's messages (each costs the chat template work, even empty)
MAX_ROLE_CHARS = 64  # "system", "user", "assistant", "tool", "developer"


MAX_CONTENT_PARTS = 4096  # a message's content parts (router/chat_content.py)
MAX_TOOLS = 1024  # a request's tools, and an assistant message's tool calls: each is rendered into the prompt


class ChatMessage(BaseModel):
    role: str = Field(max_length=MAX_ROLE_CHARS)
    # A string, or a list of parts (router/chat_content.py reads them, as vLLM does); none (null or
    # absent) is empty, as an assistant's that only calls tools.
    content: str | Annotated[list[StrictStr | dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    # What the chat template gets besides, as vLLM passes them: an assistant's tool calls (and
    # reasoning), a tool's answer's call id, a participant's name.
    tool_calls: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


class TemplateArgs(BaseModel):
    """The chat template's arguments (router/chat_template.py), with vLLM's defaults: chat and
    /tokenize take them alike."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(CommonRequest, TemplateArgs):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None
    # Checked by router/tool_choice.py as vLLM checks them; typed loosely so its words are the 400's.
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    include_reasoning: bool = True  # vLLM's: False drops the reasoning (router/chat_parsers.py)


class TokenizeRequest(TemplateArgs):
    """vLLM's /tokenize: a prompt, or chat messages (with the chat template applied)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None  # given to the template, as chat's


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class PdUsage(BaseModel):
    p_cached_tokens: int
    d_cached_tokens: int
    transferred_tokens: int
    transfer_error: str | None = None  # set when the KV pull failed and D recomputed the prompt
    prefill_instance: str | None = None  # the instance that prefilled the prompt: a P, or the D itself
    local_prefill: bool = False  # D prefilled it itself: no P computed it
    pool_tokens: int = 0  # its prefiller (D, or P) read these prompt tokens from a P's host tier (the pool)
    # Moves off a lost instance; after one, the cache counts are the last attempt's (its prompt
    # is the original one plus the tokens already sent).
    migrations: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    pd: PdUsage
    # vLLM's, with a reasoning parser: {"reasoning_tokens": n} (router/chat_parsers.py)
    completion_tokens_details: dict[str, int] | None = None


class ApiError(Exception):
    """A request the client got wrong; becomes an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


M = TypeVar("M", bound=BaseModel)


_decode_json = msgspec.json.Decoder().decode


@functools.cache
def _length_limits(model: type[BaseModel]) -> dict[str, tuple[int, tuple[type, ...]]]:
    """field -> (the max_length, of which of list and str) the client may send there: the field's
    own, or one member's of its union (`stop`: a string, or at most MAX_STOPS of them)."""
    limits = {}
    for name, field in model.model_fields.items():
        found = [(m.max_length, (list, str)) for m in field.metadata if isinstance(m, annotated_types.MaxLen)]
        for member in typing.get_args(field.annotation):
            kind = typing.get_origin(typing.get_args(member)[0]) if hasattr(member, "__metadata__") else None
            found += [(m.max_length, (kind,)) for extra in getattr(member, "__metadata__", ())
                      for m in getattr(extra, "metadata", [extra]) if isinstance(m, annotated_types.MaxLen)]
        if found:
            limits[name] = min(found, key=lambda f: f[0])
    return limits


def _check_lengths(model: type[BaseModel], obj: dict) -> None:
    """The client's lists and strings over their fields' max_length, refused before validation
    (which would first validate every item)."""
    for name, (limit, kinds) in _length_limits(model).items():
        value = obj.get(name)
        if isinstance(value, kinds) and len(value) > limit:
            what = "characters" if isinstance(value, str) else "items"
            raise ApiError(f"'{name}' has {len(value)} {what}, at most {limit}", param=name)


def parse_body(request: HttpRequest, model: type[M]) -> M:
    # Every malformed request is a 400 with an OpenAI body naming the field.
    try:
        obj = _decode_json(request.body)
    except RecursionError:  # msgspec's decoder recurses per level
        raise ApiError("the JSON body nests too deeply") from None
    except msgspec.DecodeError as e:  # not JSON, NaN, bad UTF-8, a number out of range
        raise ApiError(f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError("the request body must be a JSON object")
    _check_lengths(model, obj)
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
