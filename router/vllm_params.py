"""vLLM's own request parameters (its server's extensions to the OpenAI API) that this router does
not serve: a request setting one to anything but vLLM's default is refused with a 400 naming it,
never served as if it were not there (issue 30: nothing accepted and then ignored).

The request models keep fields they do not declare (`model_extra`); each endpoint's table below
lists every field the installed vLLM's request model has beyond the router's, with the values that
mean what the router does anyway. tests/test_vllm_params.py holds the tables to the installed
vLLM's models: a new vLLM field must be served, listed here, or named harmless there.
"""

from __future__ import annotations

from typing import Any

from pdcluster.router.openai_models import CommonRequest, refuse_unless_off

# Both endpoints: (field, the values that are the router's behaviour: vLLM's defaults).
_COMMON: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "watermarking": (None, False),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (None,), "truncation_side": (None,),
    "logprob_token_ids": (None, []), "priority": (0,),
    "return_tokens_as_token_ids": (None, False), "routed_experts_prompt_start": (0,),
    "return_token_offsets": (None, False), "cache_salt": (None,), "kv_transfer_params": (None,),
    "ec_transfer_params": (None,), "vllm_xargs": (None,), "repetition_detection": (None,),
    "thinking_token_budget": (None,), "stream_interval": (None,),
}
COMPLETION_ONLY: dict[str, tuple[Any, ...]] = _COMMON | {
    "prompt_embeds": (None,), "add_special_tokens": (True,)}
CHAT_ONLY: dict[str, tuple[Any, ...]] = _COMMON | {
    "echo": (False,), "add_special_tokens": (False,), "documents": (None,), "chat_template": (None,),
    "reasoning_effort": (None,), "include_reasoning": (True,),
    "parallel_tool_calls": (None, True), "return_prompt_text": (None, False)}


def refuse_vllm_only(req: CommonRequest, chat: bool) -> None:
    extra = req.model_extra
    if not extra:
        return
    table = CHAT_ONLY if chat else COMPLETION_ONLY
    for name, value in extra.items():
        if name in table:
            refuse_unless_off(name, value, table[name])
