"""Chat messages whose content is a list of parts (router/chat_content.py), as vLLM's server takes
them: text parts joined for a template that reads content as a string, kept as parts for one that
iterates over it (vLLM's own reading of the template decides), anything but text refused."""

from __future__ import annotations

import pytest
from router_fakes import bad_request

from pdcluster.cluster.tiny_model import CHAT_TEMPLATE as TEMPLATE
from pdcluster.router.chat_content import content_format, developer_as_system, template_messages
from pdcluster.router.openai_models import ChatMessage

ITERATES = "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}"


def tokens(client, content) -> list[int]:
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_vllm_reads_the_tiny_template_as_string_and_an_iterating_one_as_openai(tok):
    assert content_format(tok.chat_template) == "string"
    assert content_format(ITERATES) == "openai"
    assert content_format(None) == "string"


def test_text_parts_are_the_texts_joined_by_newlines_for_a_string_template(fake_router):
    client, backend = fake_router()
    parts = [{"type": "text", "text": "first"}, "second", {"type": "input_text", "text": "third"},
             {"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hm"}, {"type": "text"}]
    want = tokens(client, "first\nsecond\nthird\nno\nhm")
    assert tokens(client, parts) == want
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    assert backend.calls[0][1] == want


def test_a_template_that_iterates_over_content_gets_the_parts():
    msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "output_text", "text": "b"}]),
            ChatMessage(role="assistant", content="plain")]
    assert template_messages(msgs, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "plain"}]


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, ["content[1]", "'image_url' part", "text only"]),
    ({"type": "input_text"}, ["content[1]", "'input_text' part needs its 'text'"]),
    ({"text": "no type"}, ["content[1]", "Missing 'type' field"]),
    ({"type": "text", "text": 5}, ["content[1]", "'text' as a string"]),
])
def test_other_parts_are_refused_naming_them(fake_router, part, words):
    client, backend = fake_router()
    err = bad_request(client, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    assert err["param"] == "messages" and all(w in err["message"] for w in words), err["message"]
    assert backend.calls == []


def test_too_many_parts_are_refused_before_the_template(fake_router):
    client, backend = fake_router()
    err = bad_request(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": ["a"] * 5000}]})
    assert "messages.0.content" in err["message"] and backend.calls == []


def test_developer_messages_are_system_ones_merged_first_for_a_template_without_the_role():
    developer = [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
                 {"role": "developer", "content": [{"type": "text", "text": "B"}, "C"]}]
    assert developer_as_system(developer, TEMPLATE) == [{"role": "system", "content": "A\n\nB\nC"},
                                                        {"role": "user", "content": "Hi"}]
    first = [{"role": "developer", "content": "B", "name": "n"}, {"role": "user", "content": "Hi"}]
    assert developer_as_system(first, TEMPLATE) == [{"role": "system", "content": "B", "name": "n"}, first[1]]
    assert developer_as_system(developer, TEMPLATE + "{% if m == 'developer' %}{% endif %}") is developer


def test_vllm_converts_developer_messages_the_same_way():
    from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system

    cases = [[{"role": "developer", "content": "B"}, {"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "A"}, {"role": "user", "content": "Hi"}, {"role": "developer", "content": "B"},
              {"role": "system", "content": ""}, {"role": "assistant", "content": "ok"}]]
    for messages in cases:
        assert developer_as_system(messages, TEMPLATE) == _consolidate_system_messages(
            _convert_developer_to_system(messages))
