"""Tools, tool_choice and reasoning on chat (router/tool_choice.py, router/chat_parsers.py): vLLM's
checks and words without a parser; with vLLM's hermes tool parser and deepseek_v3 reasoning parser
on a fake D's answers, the calls and reasoning split off as vLLM's server splits them."""

from __future__ import annotations

import dataclasses
import json

import pytest
from router_fakes import FakeBackend, bad_request, sse_events, tok, tok_dir  # noqa: F401
from starlette.testclient import TestClient

from pdcluster.router.openai_api import build_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def parsers(tok_dir):  # noqa: F811
    from pdcluster.router.chat_parsers import ChatParsers

    return ChatParsers(tok_dir, "hermes", "deepseek_v3", True)


def router(tok, tok_dir, parsers, text: str):  # noqa: F811
    backend = FakeBackend(len(tok), script=tok.encode(text), final=[tok.eos_token_id])
    backend.card = dataclasses.replace(backend.card, max_model_len=4096)  # the tools' system turn is long
    return TestClient(build_app(backend, tok_dir, parsers=parsers)), backend


@pytest.mark.parametrize("body, message", [
    ({"tools": []}, "`tools` must not be an empty array"),
    ({"tools": TOOLS}, '"auto" tool choice requires model.enable_auto_tool_choice and model.tool_call_parser'),
    ({"tools": TOOLS, "tool_choice": "required"}, 'tool_choice="required" requires model.tool_call_parser'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     'tool_choice=function "get_weather" requires model.tool_call_parser'),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "Invalid value for `tool_choice`: sometimes!"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
])
def test_without_a_tool_parser_what_vllm_serve_refuses_is_refused(tok, tok_dir, body, message):  # noqa: F811
    client, backend = router(tok, tok_dir, None, "x")
    assert message in bad_request(client, "/v1/chat/completions", {"messages": MESSAGES, **body})["message"]
    assert backend.calls == []


def test_completions_take_no_tools(tok, tok_dir):  # noqa: F811
    client, backend = router(tok, tok_dir, None, "x")
    err = bad_request(client, "/v1/completions", {"prompt": "a", "tools": TOOLS})
    assert (err["param"], err["message"]) == ("tools", "'tools' is not supported by this server")


def test_tool_choice_none_serves_with_the_tools_in_the_prompt(tok, tok_dir):  # noqa: F811
    client, backend = router(tok, tok_dir, None, CALL)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == CALL
    want = tok.apply_chat_template(MESSAGES, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "the weather", "parameters": TOOLS[0]["function"]["parameters"]}}],
        tokenize=True, add_generation_prompt=True, return_dict=False)
    assert backend.calls[-1][1] == want


def test_a_conversation_with_tool_calls_and_answers_renders_as_the_template_says(tok, tok_dir):  # noqa: F811
    client, backend = router(tok, tok_dir, None, "x")
    turns = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert client.post("/v1/chat/completions", json={"messages": turns}).status_code == 200
    text = tok.decode(backend.calls[-1][1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_auto_parses_the_call_out_of_the_answer(tok, tok_dir, parsers):  # noqa: F811
    client, backend = router(tok, tok_dir, parsers, CALL)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["id"]
    assert backend.calls[-1][2].structured is None  # auto: the model chooses, unconstrained
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_streamed_call_comes_in_deltas_that_add_up_to_it(tok, tok_dir, parsers):  # noqa: F811
    client, _ = router(tok, tok_dir, parsers, CALL)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "stream": True})
    events = sse_events(r)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize("choice, once", [("required", False),
                                          ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_required_and_named_send_d_the_parsers_structural_tag(tok, tok_dir, parsers, choice, once):  # noqa: F811
    client, backend = router(tok, tok_dir, parsers, CALL)
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice})
    tag = json.loads(backend.calls[-1][2].structured.structural_tag)
    assert tag["format"]["stop_after_first"] is once and "get_weather" in tag["format"]["tags"][0]["begin"]
    out = r.json()["choices"][0]
    assert out["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert out["finish_reason"] == ("stop" if once else "tool_calls")


def test_reasoning_comes_apart_when_the_template_thinks(tok, tok_dir, parsers):  # noqa: F811
    client, _ = router(tok, tok_dir, parsers, "I ponder</think>The answer")
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("I ponder", "The answer")
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "I ponder"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer"
    plain = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()["choices"][0]["message"]
    assert (plain["reasoning"], plain["content"]) == (None, "I ponder</think>The answer")


def test_parallel_tool_calls_false_keeps_the_first_call(tok, tok_dir, parsers):  # noqa: F811
    client, _ = router(tok, tok_dir, parsers, CALL + "\n" + CALL.replace("Paris", "Rome"))
    body = {"messages": MESSAGES, "tools": TOOLS}
    assert len(client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]) == 2
    calls = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
    assert [c["function"]["arguments"] for c in calls["choices"][0]["message"]["tool_calls"]] == ['{"city": "Paris"}']


@pytest.mark.parametrize("version", ["0.23.0", "0.26.0"])
def test_before_vllm_032_the_parsers_are_refused_naming_the_version(version, tok_dir, monkeypatch):  # noqa: F811
    from pdcluster.router.chat_parsers import ChatParsers
    from pdcluster.transfer import vllm_compat

    why = vllm_compat.parsers_refusal(version)
    assert f"vLLM {version} is installed" in why and "need vLLM 0.32.0 or later" in why
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: version)
    with pytest.raises(ValueError, match=f"vLLM {version} is installed"):
        ChatParsers(tok_dir, "hermes", None, True)


def test_from_vllm_032_the_parsers_run():
    from pdcluster.transfer.vllm_compat import PARSERS_SINCE, SUPPORTED, parsers_refusal

    assert [v for v in SUPPORTED if parsers_refusal(v) is None] == list(SUPPORTED[SUPPORTED.index(PARSERS_SINCE):])


def test_the_template_gets_the_tools_as_vllm_dumps_them():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    from pdcluster.router.tool_choice import template_tools

    shapes = [*TOOLS, {"function": {"name": "bare"}}, {"type": "function", "function": {
        "name": "extra", "description": "d", "strict": True, "x": 1}, "y": 2},
              {"defer_loading": True, "function": {"name": "later", "strict": False}},
              {"defer_loading": False, "function": {"name": "own", "defer_loading": True}}]
    assert template_tools(shapes) == [ChatCompletionToolsParam.model_validate(t).model_dump() for t in shapes]


def test_tokenize_renders_the_tools_as_chat_does(tok, tok_dir):  # noqa: F811
    client, backend = router(tok, tok_dir, None, "x")
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    r = client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.json()["tokens"] == backend.calls[-1][1]
