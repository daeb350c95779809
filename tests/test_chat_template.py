"""The chat template's arguments (router/chat_template.py), as vLLM's server resolves them: the
request's chat_template_kwargs, overridden by add_generation_prompt and continue_final_message,
filtered to what the template reads and the tokenizer's call takes."""

from __future__ import annotations

import pytest
from router_fakes import bad_request

from pdcluster.router.chat_template import template_kwargs

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello th"}]


def tokenize(client, **extra) -> list[int]:
    r = client.post("/tokenize", json={"messages": MESSAGES, **extra})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_each_argument_reaches_the_template_as_hf_applies_it(fake_router, tok):
    client, backend = fake_router()
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                   {"add_generation_prompt": False, "continue_final_message": True}):
        want = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=False, **kwargs)
        assert tokenize(client, **kwargs) == want
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **kwargs})
        assert r.status_code == 200 and backend.calls[-1][1] == want
    # continued: the prompt ends inside the assistant's message, with no end-of-turn after it
    assert tok.decode(backend.calls[-1][1]).endswith("Hello th")


def test_kwargs_the_template_does_not_read_are_dropped_and_the_explicit_fields_win(tok):
    got = template_kwargs(tok, {"thinking": False, "add_generation_prompt": False, "return_tensors": "pt"},
                          add_generation_prompt=True, continue_final_message=False)
    assert got == {"add_generation_prompt": True, "continue_final_message": False}
    reads = type("T", (), {"chat_template": "{{ enable_thinking }}", "apply_chat_template": tok.apply_chat_template})()
    assert template_kwargs(reads, {"enable_thinking": False}, True, False)["enable_thinking"] is False


@pytest.mark.parametrize("body, message", [
    ({"add_generation_prompt": True, "continue_final_message": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "Found unexpected chat template kwargs from request"),
])
def test_bad_arguments_are_400s(fake_router, body, message):
    client, backend = fake_router()
    err = bad_request(client, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert message in err["message"] and backend.calls == []
