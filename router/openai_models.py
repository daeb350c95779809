"""The OpenAI API's request and response bodies, and how a request body is parsed.

Every malformed request becomes an `ApiError`: HTTP 400 (unless it says otherwise)
with an OpenAI-style body naming the field.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from pdcluster.router.http_app import HttpRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonRequest(BaseModel):
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


class CompletionRequest(CommonRequest):
    # Strict types: lax pydantic would turn `true` or "5" into token ids.
    prompt: StrictStr | list[StrictInt] | list[StrictStr | list[StrictInt]]
    echo: bool | None = None
    logprobs: int | None = None


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(CommonRequest):
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
    prefill_instance: str | None = None  # the instance that prefilled the prompt: a P, or the D itself
    local_prefill: bool = False  # D prefilled it itself: no P, no transfer


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


def parse_body(request: HttpRequest, model: type[M]) -> M:
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
