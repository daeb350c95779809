"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked as vLLM's server
checks them (0.32: ChatCompletionRequest.check_tool_usage, then OnlineRenderer.render_chat), with
its words and statuses, and the tools as its chat template gets them (each tool's model_dump).
What the choice then means (the call forced, the answer parsed) vLLM's parser reads from the
request itself.

What a tool call needs past this (the constraint D samples under, the parse of D's answer) is
vLLM's own tool parser's work (router/chat_parsers.py): without one configured, only
`tool_choice: "none"` is served, as by vllm serve without --tool-call-parser.
"""

from __future__ import annotations

from typing import Any

from pdcluster.router.openai_models import ApiError

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def checked_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, choice_given: bool,
                  tool_parser: bool) -> list[dict[str, Any]] | None:
    """The tools as the template gets them (None: none), once the three are as vLLM takes them.
    `choice_given`: the body has a `tool_choice` (an absent one is "auto" with tools, as vLLM's);
    `tool_parser`: the spec runs a tool parser (model.enable_auto_tool_choice)."""
    if tools == []:
        raise ApiError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", param="tools")
    dumped = None if tools is None else template_tools(tools)
    if not choice_given or tool_choice is None:
        tool_choice = "auto" if dumped else "none"
    if not isinstance(parallel_tool_calls, (bool, type(None))):
        raise ApiError("invalid 'parallel_tool_calls': Input should be a valid boolean", param="parallel_tool_calls")
    if tool_choice == "none":
        return dumped
    if dumped is None:
        raise ApiError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    function = _named(tool_choice, dumped) if isinstance(tool_choice, dict) else None
    if function is None and tool_choice not in ("auto", "required"):
        raise ApiError(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, \"none\", \"auto\" or "
                       "\"required\" are supported.", param="tool_choice")
    if not tool_parser:
        if tool_choice == "auto":
            raise ApiError('"auto" tool choice requires model.enable_auto_tool_choice and model.tool_call_parser '
                           "to be set (vllm serve's --enable-auto-tool-choice and --tool-call-parser)",
                           param="tool_choice")
        what = f'function "{function}"' if function is not None else f'"{tool_choice}"'
        raise ApiError(f"tool_choice={what} requires model.tool_call_parser to be set (vllm serve's "
                       "--tool-call-parser)", param="tool_choice")
    return dumped


def template_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools as the chat template gets them (chat, and /tokenize's messages): vLLM's
    ChatCompletionToolsParam.model_dump of each tool: type, and the function's name,
    description and parameters (None where not given), strict and defer_loading where given (the
    tool's defer_loading its function's too, unless that has its own); other keys dropped."""
    if not isinstance(tools, list):
        raise ApiError("invalid 'tools': Input should be a valid list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(f"invalid 'tools.{i}': a tool is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param="tools")
        if tool.get("type", "function") != "function":
            raise ApiError(f"invalid 'tools.{i}.type': Input should be 'function'", param="tools")
        description, parameters = function.get("description"), function.get("parameters")
        if not isinstance(description, (str, type(None))) or not isinstance(parameters, (dict, type(None))):
            raise ApiError(f"invalid 'tools.{i}.function': description is a string, parameters an object",
                           param="tools")
        dumped = {"name": function["name"], "description": description, "parameters": parameters}
        # strict and defer_loading only when given (defer_loading may be the tool's), as vLLM's serializer
        for key, value in (("strict", function.get("strict")),
                           ("defer_loading", function.get("defer_loading", tool.get("defer_loading")))):
            if value is not None:
                if not isinstance(value, bool):
                    raise ApiError(f"invalid 'tools.{i}.function.{key}': Input should be a valid boolean",
                                   param="tools")
                dumped[key] = value
        tool_level = tool.get("defer_loading")
        if not isinstance(tool_level, (bool, type(None))):
            raise ApiError(f"invalid 'tools.{i}.defer_loading': Input should be a valid boolean", param="tools")
        out.append({"type": "function", "function": dumped} | ({} if tool_level is None else {"defer_loading": tool_level}))
    return out


def _named(tool_choice: dict, tools: list[dict[str, Any]]) -> str:
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ApiError(f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}",
                       param="tool_choice.function")
    if "name" not in function:
        raise ApiError(f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
                       param="tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ApiError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}",
                       param="tool_choice.function.name")
    if all(tool["function"]["name"] != name for tool in tools):
        raise ApiError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                       param="tool_choice")
    return name
