"""Unit tests of the OpenAI-compatible front end (router/openai_api.py) over a scripted fake backend."""

from __future__ import annotations

import time

import httpx
import pytest
from router_fakes import MAX_LEN, MODEL, TEXT, FakeBackend, bad_request, serve_in_thread, sse_events

from pdcluster.proto.messages import SamplingSpec
from pdcluster.router.backend import BackendError
from pdcluster.router.openai_api import build_app


def test_completion_text_prompt(fake_router, tok):
    client, backend = fake_router()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 20,
                                             "temperature": 0, "top_k": -1, "seed": 7, "user": "u",
                                             "stop_token_ids": [5], "ignore_eos": True, "unknown_x": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    [(rid, ids, sampling)] = backend.calls
    assert ids == tok.encode("Once upon")
    assert sampling == SamplingSpec(max_tokens=20, temperature=0.0, top_p=1.0, top_k=0, seed=7,
                                    ignore_eos=True, stop_token_ids=(5,), final_only=True)
    assert body["id"] == rid and rid.startswith("cmpl-") and len(rid) == 5 + 32
    assert body["object"] == "text_completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None}]
    n_out = len(tok.encode(TEXT)) + 1  # the eos counts as a completion token but is not text
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_out,
                             "total_tokens": len(ids) + n_out, "prompt_tokens_details": {"cached_tokens": 3},
                             "pd": {"p_cached_tokens": 3, "d_cached_tokens": 1, "transferred_tokens": 5,
                                    "transfer_error": None, "prefill_instance": "prefill-0", "local_prefill": False,
                                    "pool_tokens": 0, "migrations": 0}}
    assert backend.closed_early == []


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_completion_token_id_prompt(fake_router, prompt):
    client, backend = fake_router(finish="length", final=[])
    r = client.post("/v1/completions", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    assert backend.calls[0][1] == [5, 6, 7]
    assert backend.calls[0][2] == SamplingSpec(final_only=True)  # defaults: 16 tokens, temperature 1
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_single_string_in_list(fake_router, tok):
    client, backend = fake_router()
    assert client.post("/v1/completions", json={"prompt": ["abc"]}).status_code == 200
    assert backend.calls[0][1] == tok.encode("abc")


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_equals_non_stream(fake_router, include_usage):
    client, backend = fake_router()
    full = client.post("/v1/completions", json={"prompt": "x"}).json()
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True,
                                             "stream_options": {"include_usage": include_usage}})
    assert r.status_code == 200
    events = sse_events(r)
    if include_usage:
        *events, last = events
        assert last["choices"] == [] and last["usage"] == full["usage"]
        assert all(e["usage"] is None for e in events)
    else:
        assert all("usage" not in e for e in events)
    texts = [e["choices"][0]["text"] for e in events]
    assert len(texts) > 5 and not any("\ufffd" in t for t in texts)  # no partial UTF-8 leaks
    assert "".join(texts) == TEXT == full["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["stop"]
    assert all(e["id"] == backend.calls[1][0] and e["object"] == "text_completion" for e in events)
    # Only the answer not streamed asks D for its tokens at the end, in one delta.
    assert [sampling.final_only for _, _, sampling in backend.calls] == [True, False]


def test_a_retention_hint_reaches_the_engines_with_the_sampling(fake_router):
    client, backend = fake_router()
    assert client.post("/v1/completions", json={"prompt": "a", "kv_retention_s": 600}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200
    assert [sampling.retain_s for _, _, sampling in backend.calls] == [600.0, 0.0]


def test_chat(fake_router, tok):
    client, backend = fake_router()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                  "max_completion_tokens": 30, "top_p": 0.5})
    assert r.status_code == 200, r.text
    expected = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    rid, ids, sampling = backend.calls[0]
    assert ids == expected and sampling.max_tokens == 30 and sampling.top_p == 0.5
    body = r.json()
    assert body["id"] == rid and rid.startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": TEXT},
                                "logprobs": None, "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"]["prompt_tokens"] == len(expected)
    # Without max_tokens, chat may use the rest of the context (OpenAI / vLLM).
    client.post("/v1/chat/completions", json={"messages": messages})
    assert backend.calls[1][2].max_tokens == MAX_LEN - len(expected)


def test_chat_stream(fake_router):
    client, _ = fake_router()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                                  "max_tokens": 40, "stream_options": {"include_usage": True}})
    *events, usage = sse_events(r)
    assert all(e["object"] == "chat.completion.chunk" for e in events + [usage])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == TEXT
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["pd"]["transferred_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["world", ["zzz", "héllo"], [" 你好"]])
def test_stop_string(fake_router, stream, stop):
    client, backend = fake_router()
    first = stop if isinstance(stop, str) else stop[-1]
    r = client.post("/v1/completions", json={"prompt": "x", "stop": stop, "stream": stream})
    assert r.status_code == 200
    if stream:
        events = sse_events(r)
        text = "".join(e["choices"][0]["text"] for e in events)
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert text == TEXT[:TEXT.index(first)] and finish == "stop"
    assert backend.closed_early == [backend.calls[0][0]]  # the router stopped consuming and closed it
    assert not backend.calls[0][2].final_only  # the router needs the tokens as they come to stop early


def test_stop_string_never_streamed_in_part(fake_router, tok):
    # "ld, h" spans several tokens: no streamed piece may carry its beginning.
    client, _ = fake_router()
    events = sse_events(client.post("/v1/completions", json={"prompt": "x", "stop": "ld, h", "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello wor"



@pytest.mark.parametrize("body,param,words", [
    ("{not json", None, ["malformed JSON"]),
    ("[1, 2]", None, ["JSON object"]),
    ({"max_tokens": 3}, "prompt", ["'prompt'", "required"]),
    ({"prompt": 5}, "prompt", ["'prompt' must be"]),
    ({"prompt": [1, True]}, "prompt", ["'prompt' must be"]),
    ({"prompt": [1.5]}, "prompt", ["'prompt' must be"]),
    ({"prompt": ["a", "b"]}, "prompt", ["batches", "not supported"]),
    ({"prompt": [[1], [2]]}, "prompt", ["batches"]),
    ({"prompt": ""}, "prompt", ["prompt is empty"]),
    ({"prompt": []}, "prompt", ["prompt is empty"]),
    ({"prompt": [1, 2, 5000, -1]}, "prompt", ["token id 5000 at index 2", "[0, "]),
    ({"prompt": [1, -1]}, "prompt", ["token id -1 at index 1"]),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", ["max_tokens", "at least 1"]),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens", ["max_tokens"]),
    ({"prompt": "a", "temperature": -0.1}, "temperature", ["temperature", "[0, 2]"]),
    ({"prompt": "a", "top_p": 0}, "top_p", ["top_p", "(0, 1]"]),
    ({"prompt": "a", "top_p": 1.5}, "top_p", ["top_p"]),
    ({"prompt": "a", "top_k": -2}, "top_k", ["top_k"]),
    ({"prompt": "a", "n": 0}, "n", ["n must be at least 1, got 0."]),
    ({"prompt": "a", "n": 2, "temperature": 0}, "n", ["n must be 1 when using greedy sampling, got 2."]),
    ({"prompt": "a", "n": 16385}, "n", ["n must be at most 16384, got 16385."]),
    ({"prompt": "a", "echo": True, "logprobs": 0, "stream": True}, "echo", ["echo with logprobs is served unstreamed"]),
    ({"prompt": "a", "logprobs": -2}, "logprobs", ["`logprobs` must be a positive value or -1."]),
    ({"prompt": "a", "logprobs": 21}, "logprobs", ["Requested sample logprobs of 21, which is greater than max "
                                                   "allowed: 20"]),
    ({"prompt": "a", "logprobs": -1}, "logprobs", ["Requested sample logprobs of"]),  # the vocabulary: over 20
    ({"prompt": "a", "logprobs": True}, "logprobs", ["logprobs"]),
    ({"prompt": "a", "stop": 3}, "stop", ["stop"]),
    ({"prompt": "a", "stream": "yes please"}, "stream", ["stream"]),
    ({"prompt": "a", "kv_retention_s": -1}, "kv_retention_s", ["kv_retention_s must be in [0, 3600] seconds"]),
    ({"prompt": "a", "kv_retention_s": 1e9}, "kv_retention_s", ["kv_retention_s"]),
    ({"prompt": "a", "kv_retention_s": "long"}, "kv_retention_s", ["kv_retention_s"]),
])
def test_completion_400(fake_router, body, param, words):
    client, backend = fake_router()
    err = bad_request(client, "/v1/completions", body)
    assert err["param"] == param
    assert all(w in err["message"] for w in words), err["message"]
    assert backend.calls == []


@pytest.mark.parametrize("body,param,words", [
    ({"model": MODEL}, "messages", ["'messages'", "required"]),
    ({"messages": []}, "messages", ["messages is empty"]),
    ({"messages": [{"content": "hi"}]}, "messages", ["'messages.0.role' is a required field"]),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", ["messages.0.content"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", ["max_completion_tokens must be at least 1"]),
])
def test_chat_400(fake_router, body, param, words):
    client, backend = fake_router()
    err = bad_request(client, "/v1/chat/completions", body)
    assert err["param"] == param
    assert all(w in err["message"] for w in words), err["message"]
    assert backend.calls == []


def test_context_length(fake_router):
    client, backend = fake_router()
    err = bad_request(client, "/v1/completions", {"prompt": list(range(10)), "max_tokens": MAX_LEN - 9})
    assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens. However, "
                                     f"you requested {MAX_LEN + 1} tokens (10 in the prompt, {MAX_LEN - 9} "
                                     "for the completion)")
    err = bad_request(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * MAX_LEN}]})
    assert "in the messages" in err["message"]
    assert client.post("/v1/completions", json={"prompt": list(range(10)),
                                                "max_tokens": MAX_LEN - 10}).status_code == 200
    assert len(backend.calls) == 1


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "a"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})])
def test_unknown_model_404(fake_router, path, body):
    client, _ = fake_router()
    err = bad_request(client, path, {**body, "model": "gpt-9"}, status=404)
    assert err["param"] == "model" and "gpt-9" in err["message"] and MODEL in err["message"]


def test_backend_error_status(fake_router):
    client, _ = fake_router(error=BackendError("no decode instance is healthy", status=503, kind="service_unavailable"))
    for stream in (False, True):  # before the first chunk the status survives in streaming too
        r = client.post("/v1/completions", json={"prompt": "a", "stream": stream})
        assert r.status_code == 503
        assert r.json() == {"error": {"message": "no decode instance is healthy", "type": "service_unavailable",
                                      "param": None, "code": None}}


def test_backend_error_mid_stream(fake_router):
    client, backend = fake_router(error=BackendError("decode-0 died", status=502, kind="server_error"), error_after=3)
    r = client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == {"error": {"message": "decode-0 died", "type": "server_error", "param": None, "code": None}}
    assert all("choices" in e for e in events[:-1]) and len(events) > 1


def test_unexpected_error_is_500(fake_router):
    client, _ = fake_router(error=RuntimeError("boom"))
    r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 500
    assert "boom" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"
    events = sse_events(fake_router(error=RuntimeError("boom"), error_after=2)[0].post(
        "/v1/completions", json={"prompt": "a", "stream": True}))
    assert "boom" in events[-1]["error"]["message"]


def test_health_and_models(fake_router):
    client, backend = fake_router()
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "instances": {"prefill-0": True, "decode-0": True}}
    backend.instances["decode-0"] = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["instances"]["decode-0"] is False
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"


def test_openai_client(tok, tok_dir):
    import openai

    backend = FakeBackend(len(tok), tok.encode(TEXT), [tok.eos_token_id])
    with serve_in_thread(build_app(backend, tok_dir)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
        c = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, temperature=0)
        assert c.choices[0].text == TEXT and c.choices[0].finish_reason == "stop"
        assert c.usage.prompt_tokens == len(tok.encode("Once")) and c.usage.prompt_tokens_details.cached_tokens == 3
        pieces = [ch for ch in client.completions.create(model=MODEL, prompt="Once", stream=True,
                                                        stream_options={"include_usage": True})]
        assert "".join(p.choices[0].text for p in pieces if p.choices) == TEXT
        assert pieces[-1].usage.completion_tokens == c.usage.completion_tokens
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.content == TEXT and chat.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == TEXT
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="Once")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model=MODEL, prompt="Once", temperature=-1)


def test_client_disconnect_closes_backend(tok, tok_dir):
    backend = FakeBackend(len(tok), [300] * 400, [], finish="length", delay=0.02)  # ~8 s if nobody stops it
    with serve_in_thread(build_app(backend, tok_dir)) as url:
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a", "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 3
        while not backend.closed_early and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backend.closed_early == [backend.calls[0][0]]


@pytest.mark.parametrize("path, body, prefix", [("/v1/completions", {"prompt": [5, 6]}, "cmpl-"),
                                                ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                         "content": "hi"}]},
                                                 "chatcmpl-")])
def test_client_request_id_header(fake_router, path, body, prefix):
    client, backend = fake_router()
    r = client.post(path, json=body, headers={"X-Request-Id": "job-42"})
    assert r.status_code == 200, r.text
    assert backend.calls[0][0] == r.json()["id"] == prefix + "job-42"


@pytest.mark.parametrize("value", ["x" * 129, "tab\there"])
def test_bad_request_id_header_is_400(fake_router, value):
    client, backend = fake_router()
    r = client.post("/v1/completions", json={"prompt": [5]}, headers={"X-Request-Id": value})
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    assert backend.calls == []


def test_sse_events_are_ascii_so_unicode_line_breaks_do_not_split_them():
    import json

    from pdcluster.router.openai_stream import sse_event as _event

    text = "a\u2028b\x85c\u00e9"
    line = _event({"choices": [{"text": text}]})
    assert line.isascii() and line.endswith("\n\n") and line.count("\n") == 2
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_stop_reason_names_the_stop_string_as_vllm_does(fake_router):
    from pdcluster.router.openai_stream import _find_stop

    client, _ = fake_router()
    [choice] = client.post("/v1/completions", json={"prompt": "a", "stop": ["zzz", "world"]}).json()["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("Hello ", "stop", "world")
    # the one that completes first, ties in the list's order (vLLM's check_stop_strings)
    assert _find_stop("xab", ("ab", "b"), 0) == ("ab", 1) and _find_stop("xab", ("b", "ab"), 0) == ("b", 2)
    assert _find_stop("xabc", ("abc", "ab"), 0) == ("ab", 1)
