"""vLLM's tool-call and reasoning parsers, run by the router on D's answers: the spec's
`model.tool_call_parser`, `model.enable_auto_tool_choice` and `model.reasoning_parser`, as
`vllm serve`'s --tool-call-parser, --enable-auto-tool-choice and --reasoning-parser.

Why vLLM's own parsers: each model family writes tool calls and reasoning its own way (~50
parsers in vLLM 0.32, streamed and not, with the grammars that force a call); parity with
`vllm serve` is theirs to keep. What the router adds is where they run: it detokenizes and
matches stop strings, so it parses what D generated, as vLLM's server parses its engine's output
(vllm/entrypoints/openai/chat_completion/serving.py, 0.32, whose branches `message` and `delta`
follow). Importing them costs a router ~6 s and ~550 MB once, at start, and only when the spec
names a parser.

For one request (`RequestParsers`): vLLM's request model is validated from the body; the
parser's `adjust_request` gives the constraint D samples under (a structural tag that forces
tool calls, for tool_choice "required" or a named function) and whether the reasoning has ended
in the prompt; each of the n choices has a parser of its own (parsers keep state).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdcluster.proto.messages import StructuredSpec
from pdcluster.router.openai_models import ApiError


class ChatParsers:
    """The spec's parsers for the model at `tokenizer_dir`, loaded once (a router's)."""

    def __init__(self, tokenizer_dir: str, tool_call_parser: str | None, reasoning_parser: str | None,
                 enable_auto_tool_choice: bool):
        from pdcluster.transfer.vllm_compat import installed_version, parsers_refusal

        if why := parsers_refusal(installed_version()):  # the names below are 0.32's (vllm_compat USES)
            raise ValueError(why)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser import ParserManager
        from vllm.tokenizers import get_tokenizer

        self._tokenizer = get_tokenizer(tokenizer_dir)
        # vLLM's: unknown names, or a tokenizer without the parser's tokens, fail here (the router's start).
        self._cls = ParserManager.get_parser(tool_parser_name=tool_call_parser, reasoning_parser_name=reasoning_parser,
                                             enable_auto_tools=enable_auto_tool_choice, tokenizer=self._tokenizer)
        self._request_model = ChatCompletionRequest
        self.auto_tools = enable_auto_tool_choice
        # What vLLM's render_chat calls "tool parsing available": required and named need it too.
        self.tool_parser = self._cls is not None and self._cls.tool_parser_cls is not None
        self.reasoning = self._cls is not None and self._cls.reasoning_parser_cls is not None

    def for_request(self, body: dict[str, Any], template_kwargs: dict[str, Any], prompt_ids: list[int],
                    n: int, structured: StructuredSpec | None) -> RequestParsers | None:
        """None when no parser is configured. `structured`: the request's own constraint."""
        if self._cls is None:
            return None
        try:
            request = self._request_model.model_validate(body)
        except ValueError as e:  # pydantic's and vLLM's validation errors
            raise ApiError(f"invalid request: {e}") from None
        make = lambda: self._cls(self._tokenizer, request.tools, chat_template_kwargs=template_kwargs)  # noqa: E731
        adjuster = make()
        before = request.structured_outputs
        if adjuster.always_adjust_request or self.reasoning or request.tool_choice != "none":
            request = adjuster.adjust_request(request)
        if request.structured_outputs is not before:  # the parser's own constraint replaces the request's
            structured = _spec(request.structured_outputs)
        parsers = [make() for _ in range(n)]
        if not request.stream:  # as vLLM's full generator; its stream generator hands parse_delta the prompt instead
            for parser in parsers:
                parser.set_prompt_token_ids(prompt_ids)
        ended = request.resolve_reasoning_ended(adjuster, prompt_ids) if structured is not None else None
        return RequestParsers(self, request, parsers, prompt_ids, structured, ended)


class RequestParsers:
    """One request's parsing: `structured` and `reasoning_ended` go to D; `message` and `delta`
    shape each choice's answer."""

    def __init__(self, owner: ChatParsers, request: Any, parsers: list[Any], prompt_ids: list[int],
                 structured: StructuredSpec | None, reasoning_ended: bool | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

        self._owner, self._request, self._parsers, self._prompt_ids = owner, request, parsers, prompt_ids
        self.structured, self.reasoning_ended = structured, reasoning_ended
        choice = request.tool_choice
        self._named = type(choice) is ChatCompletionNamedToolChoiceParam
        self._required = choice == "required"
        self._auto = bool(request.tools) and choice in ("auto", None) and owner.auto_tools and owner.tool_parser
        self._streamed_tools = [False] * len(parsers)
        self.hide_metadata = not request.include_reasoning  # vLLM's: no logprobs or token ids that show reasoning

    def message(self, index: int, text: str, token_ids: Sequence[int], finish: str) -> tuple[dict[str, Any], str]:
        """Choice `index`'s unstreamed message, and its finish reason ("tool_calls" when it called one)."""
        request = self._request
        reasoning, content, calls = self._parsers[index].parse(text, request, enable_auto_tools=self._owner.auto_tools,
                                                               model_output_token_ids=token_ids)
        if not request.include_reasoning:
            reasoning = None
        called = False
        if self._named or self._required:
            content = content or ""
        elif self._auto:
            called = bool(calls)
        else:
            calls = []
        message = {"role": "assistant", "content": content, "reasoning": reasoning}
        if calls:
            shown = [{"id": c.id or _tool_call_id(), "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            message["tool_calls"] = shown if request.parallel_tool_calls is not False else shown[:1]
        return message, "tool_calls" if called or (self._required and finish == "stop") else finish

    def delta(self, index: int, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """Choice `index`'s streamed delta: vLLM's DeltaMessage as its chunk shows it, or None when
        the parser holds this text back (markup, or a call not complete yet)."""
        found = self._parsers[index].parse_delta(text, token_ids, self._request, self._prompt_ids, finished=finished)
        if found is None:
            return None
        if found.tool_calls:
            self._streamed_tools[index] = True
            if self._request.parallel_tool_calls is False:
                found.tool_calls = [call for call in found.tool_calls if call.index == 0]
        return found.model_dump(exclude_unset=True)

    def finish(self, index: int, finish: str) -> str:
        """A streamed choice's finish reason: "tool_calls" when it streamed one, unless named."""
        return "tool_calls" if self._streamed_tools[index] and not self._named and finish == "stop" else finish

    def reasoning_tokens(self, index: int, token_ids: Sequence[int]) -> int | None:
        """vLLM's usage.completion_tokens_details.reasoning_tokens (with a reasoning parser only)."""
        return self._parsers[index].count_reasoning_tokens(tuple(token_ids)) if self._owner.reasoning else None


def _tool_call_id() -> str:
    from vllm.renderers.chat_utils import make_tool_call_id

    return make_tool_call_id()


def _spec(params: Any) -> StructuredSpec | None:
    """vLLM's StructuredOutputsParams as the spec D's vLLM rebuilds them from."""
    if params is None:
        return None
    schema = params.json
    return StructuredSpec(json=None if schema is None else schema if isinstance(schema, str) else json.dumps(schema),
                          regex=params.regex, choice=None if params.choice is None else tuple(params.choice),
                          grammar=params.grammar, json_object=params.json_object,
                          disable_any_whitespace=params.disable_any_whitespace,
                          disable_additional_properties=params.disable_additional_properties,
                          whitespace_pattern=params.whitespace_pattern, structural_tag=params.structural_tag)
