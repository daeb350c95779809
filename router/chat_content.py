"""Chat messages whose `content` is a list of parts, as the OpenAI SDKs and agent frameworks send
them, turned into what the chat template takes, as vLLM's server does
(vllm/renderers/chat_utils.py `_parse_chat_message_content_parts`, 0.32):

- text parts: `text`, `input_text`, `output_text` (their `text`), `refusal` (its `refusal`),
  `thinking` (its `thinking`), or a bare string; a `text` or `refusal` part without one is skipped;
- a template that reads `content` as a string gets the texts joined by newlines; one that iterates
  over it (vLLM's "openai" content format) gets `[{"type": "text", "text": ...}, ...]`;
- any other part (images, audio, files) is refused with a 400: the model takes text.

Which of the two a template is, vLLM decides from the template's syntax tree
(vllm/renderers/hf.py `_detect_content_format`). Importing that part of vLLM costs a process
~4 s and ~450 MB, which the router does not carry: `content_format` asks it once, in a child
process, when the first request with list content comes.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from typing import Any

from pdcluster.router.openai_models import ApiError

log = logging.getLogger(__name__)

TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
             "thinking": "thinking"}  # vLLM's text part types, and the key holding each one's text
_SKIP_WITHOUT_TEXT = ("text", "refusal")
_DETECT = ("import sys; from vllm.renderers.hf import _detect_content_format as d; "
           "print(d(sys.stdin.read(), default='string'))")
DETECT_TIMEOUT_S = 120.0


@functools.lru_cache(maxsize=8)
def content_format(chat_template: str | None) -> str:
    """"string" or "openai", as vLLM's own function reads the template, in a child process (once
    per template and process). Blocking: run it off the event loop."""
    if not chat_template:
        return "string"
    try:
        out = subprocess.run([sys.executable, "-c", _DETECT], input=chat_template, capture_output=True, text=True,
                             timeout=DETECT_TIMEOUT_S, check=True).stdout.strip().splitlines()
    except (subprocess.SubprocessError, OSError) as err:
        detail = getattr(err, "stderr", "") or ""
        log.error("could not ask vLLM the chat template's content format (taking 'string'): %s %s",
                  err, detail[-500:])
        return "string"
    return out[-1] if out and out[-1] in ("string", "openai") else "string"


def template_messages(messages: list[Any], fmt: str) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; `fmt`: content_format's answer. Besides the
    content, as vLLM's `_parse_chat_message_content`: an assistant's tool calls (arguments as
    objects) and reasoning, a tool's call id (its list content joined, whatever `fmt`), any name."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if m.content is not None else []
        if not isinstance(content, str):
            texts = [text for j, part in enumerate(content) if (text := _text(part, i, j)) is not None]
            openai = fmt == "openai" and m.role != "tool"
            content = [{"type": "text", "text": t} for t in texts] if openai else "\n".join(texts)
        message = {"role": m.role, "content": content}
        if m.role == "assistant":
            if m.tool_calls:  # an empty list is dropped, as vLLM drops it
                message["tool_calls"] = [_tool_call(call, i) for call in m.tool_calls]
            if m.reasoning is not None:
                message |= {"reasoning": m.reasoning, "reasoning_content": m.reasoning}
        elif m.role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def developer_as_system(messages: list[dict[str, Any]], chat_template: str | None) -> list[dict[str, Any]]:
    """As vLLM's renderer (vllm/renderers/hf.py, 0.32): for a template that never names the
    'developer' role (OpenAI's newer word for system), developer messages become system ones, and
    every system message is then merged into one, first (templates such as Qwen's take a system
    message first only)."""
    template = chat_template or ""
    if '"developer"' in template or "'developer'" in template or all(m["role"] != "developer" for m in messages):
        return messages
    turned = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(turned) if m["role"] == "system"]
    if systems in ([], [0]):
        return turned
    texts = [text for i in systems if (text := _joined(turned[i]["content"]))]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in turned if m["role"] != "system")]


def _joined(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                         if isinstance(p, str) or isinstance(p, dict) and "text" in p)
    return content


def _tool_call(call: Any, i: int) -> dict[str, Any]:
    """An assistant's tool call as vLLM's `_postprocess_messages` hands templates one: its
    arguments an object (a JSON text parsed; one that is not an object's text, {})."""
    if not isinstance(call, dict):
        raise ApiError("assistant tool_calls entries must be objects.", param="tool_calls")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ApiError("chat completions only support assistant tool_calls of type 'function'.", param="tool_calls")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except ValueError:  # kept in the history: failing would fail every later turn (vLLM's reason)
            log.warning("messages[%d]: a tool call's arguments are not JSON; taken as {}", i)
            arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def _text(part: Any, i: int, j: int) -> str | None:
    """A part's text; None: skipped, as vLLM skips it."""
    if isinstance(part, str):
        return part
    where = f"messages[{i}].content[{j}]"
    kind = part.get("type")
    if not isinstance(kind, str):
        raise ApiError(f"{where}: Missing 'type' field in multimodal part.", param="messages")
    if kind not in TEXT_KEYS:
        raise ApiError(f"{where}: a '{kind}' part is not supported: this model takes text only", param="messages")
    text = part.get(TEXT_KEYS[kind])
    if text is None and kind in _SKIP_WITHOUT_TEXT:
        return None
    if not isinstance(text, str):
        raise ApiError(f"{where}: a '{kind}' part needs its '{TEXT_KEYS[kind]}' as a string", param="messages")
    return text
