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
    """The messages as the chat template takes them; `fmt`: content_format's answer."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if not isinstance(content, str):
            texts = [text for j, part in enumerate(content) if (text := _text(part, i, j)) is not None]
            content = [{"type": "text", "text": t} for t in texts] if fmt == "openai" else "\n".join(texts)
        out.append({"role": m.role, "content": content})
    return out


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
