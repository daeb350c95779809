"""vLLM's own request parameters the router does not serve (router/vllm_params.py): refused unless
at vLLM's default, and the tables hold every field the installed vLLM's request models have."""

from __future__ import annotations

import pytest
from router_fakes import bad_request

from pdcluster.router.openai_models import ChatCompletionRequest, CompletionRequest
from pdcluster.router.vllm_params import CHAT_ONLY, COMPLETION_ONLY

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# Fields of vLLM's request models that change nothing the router answers: the response's id
# (ids aside), an affinity hint, and multimodal inputs' options (a text model has none).
HARMLESS = {"request_id", "session_id", "mm_payload", "return_mm_kwargs", "media_io_kwargs", "mm_processor_kwargs"}


@pytest.mark.parametrize("ours,theirs,table", [
    (CompletionRequest, "vllm.entrypoints.openai.completion.protocol", COMPLETION_ONLY),
    (ChatCompletionRequest, "vllm.entrypoints.openai.chat_completion.protocol", CHAT_ONLY)])
def test_every_field_of_vllms_request_models_is_served_refused_or_harmless(ours, theirs, table):
    import importlib

    vllm_model = getattr(importlib.import_module(theirs), ours.__name__)
    unlisted = set(vllm_model.model_fields) - set(ours.model_fields) - set(table) - HARMLESS
    assert not unlisted, f"vLLM's {ours.__name__} fields the router neither serves nor refuses: {sorted(unlisted)}"
    for name, off in table.items():  # each table default is vLLM's own
        if name in vllm_model.model_fields and name not in ours.model_fields:
            default = vllm_model.model_fields[name].default
            assert any(type(default) is type(o) and default == o for o in off), (name, default, off)


@pytest.mark.parametrize("path,body,field,value", [
    ("/v1/completions", {"prompt": "a"}, "skip_special_tokens", False),
    ("/v1/completions", {"prompt": "a"}, "include_stop_str_in_output", True),
    ("/v1/completions", {"prompt": "a"}, "add_special_tokens", False),
    ("/v1/completions", {"prompt": "a"}, "priority", 1),
    ("/v1/completions", {"prompt": "a"}, "cache_salt", "tenant-1"),
    ("/v1/chat/completions", CHAT, "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", CHAT, "documents", [{"title": "t", "text": "x"}]),
    ("/v1/chat/completions", CHAT, "echo", True),
])
def test_vllms_parameters_the_router_does_not_serve_are_400_unless_at_their_default(fake_router, path, body, field,
                                                                                    value):
    client, backend = fake_router()
    err = bad_request(client, path, {**body, field: value})
    assert err["param"] == field and f"'{field}' is not supported by this server" in err["message"]
    assert backend.calls == []
    default = (CHAT_ONLY if "chat" in path else COMPLETION_ONLY)[field][0]
    assert client.post(path, json={**body, field: default, "some_other_field": [1]}).status_code == 200
