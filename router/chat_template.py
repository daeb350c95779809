"""The chat template's arguments for one request, as vLLM's server resolves them
(vllm/entrypoints/openai/chat_completion/protocol.py `build_chat_params`, vllm/renderers/hf.py
`resolve_chat_template_kwargs`, 0.32): the request's `chat_template_kwargs`, overridden by its
`add_generation_prompt` and `continue_final_message`; of those, the template gets the names it
reads and the names the tokenizer's `apply_chat_template` takes, and nothing else (so
`enable_thinking` reaches a template that reads it, and is dropped by one that does not).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from pdcluster.router.openai_models import ApiError

# vLLM refuses these in a request's kwargs: the template is the server's, and tokenizing the router's.
UNEXPECTED = frozenset({"chat_template", "tokenize"})
# apply_chat_template's arguments that shape what it returns, not the prompt's text (vLLM renders
# the text and tokenizes it apart, so they change nothing there): the router's call sets its own.
RETURN_SHAPE = frozenset({"conversation", "return_dict", "return_tensors", "padding", "truncation", "max_length",
                          "tokenizer_kwargs", "return_assistant_tokens_mask"})


def template_kwargs(tokenizer: Any, request_kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                    continue_final_message: bool) -> dict[str, Any]:
    if continue_final_message and add_generation_prompt:
        raise ApiError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    given = request_kwargs or {}
    if unexpected := UNEXPECTED & given.keys():
        raise ApiError(f"Found unexpected chat template kwargs from request: {unexpected}",
                       param="chat_template_kwargs")
    merged = given | {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    accepted = (_template_names(getattr(tokenizer, "chat_template", None) or "")
                | _call_names(type(tokenizer))) - UNEXPECTED - RETURN_SHAPE
    return {k: v for k, v in merged.items() if k in accepted}


@functools.lru_cache(maxsize=8)
def _template_names(chat_template: str) -> frozenset[str]:
    """The names the template reads from outside (jinja2's undeclared variables), parsed as
    vLLM parses it (its `generation` tag aside: a template using it parses with it only)."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(chat_template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


@functools.lru_cache(maxsize=8)
def _call_names(tokenizer_class: type) -> frozenset[str]:
    params = inspect.signature(tokenizer_class.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) - {"self"}
