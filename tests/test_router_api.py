"""Unit tests of the OpenAI-compatible front end (router/openai_api.py) over a scripted fake backend."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from starlette.testclient import TestClient

from pdcluster.cluster.messages import SamplingSpec
from pdcluster.cluster.tiny_model import make_tiny_model
from pdcluster.router.backend import BackendError, GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.openai_api import build_app

MODEL = "tiny"
MAX_LEN = 64
TEXT = "Hello world, héllo 你好 the end."


class FakeBackend(TokenBackend):
    """Yields `script` (token ids, one chunk each) then a final chunk; records calls and early closes."""

    def __init__(self, vocab_size: int, script: list[int], final: list[int], finish: str = "stop",
                 error: Exception | None = None, error_after: int = 0, delay: float = 0.0):
        self.card = ModelCard(name=MODEL, max_model_len=MAX_LEN, vocab_size=vocab_size)
        self.script, self.final, self.finish = script, final, finish
        self.error, self.error_after, self.delay = error, error_after, delay
        self.calls: list[tuple[str, list[int], SamplingSpec]] = []
        self.closed_early: list[str] = []  # request ids whose iterator was closed before the end
        self.instances = {"prefill-0": True, "decode-0": True}

    def model_card(self) -> ModelCard:
        return self.card

    async def generate(self, request_id, prompt_token_ids, sampling, arrival_ns=None):
        self.calls.append((request_id, list(prompt_token_ids), sampling))
        done = False
        try:
            for i, t in enumerate(self.script):
                if self.error is not None and i == self.error_after:
                    raise self.error
                await asyncio.sleep(self.delay)
                yield GenerationChunk([t])
            yield GenerationChunk(self.final, finish_reason=self.finish, p_cached_tokens=3,
                                  d_cached_tokens=1, transferred_tokens=5, prefill_instance="prefill-0")
            done = True
        finally:  # closed (GeneratorExit) or cancelled (CancelledError) before the end
            if not done and self.error is None:
                self.closed_early.append(request_id)

    async def health(self):
        return dict(self.instances)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture
def make(tok, tok_dir):
    """make(**backend kwargs) -> (TestClient, FakeBackend); by default it generates TEXT then eos."""

    def _make(**kw):
        kw.setdefault("script", tok.encode(TEXT))
        kw.setdefault("final", [tok.eos_token_id])
        backend = FakeBackend(len(tok), **kw)
        return TestClient(build_app(backend, tok_dir)), backend

    return _make


def sse_events(resp) -> list:
    """Parses an SSE body; returns the JSON payloads and checks it ends in exactly one [DONE]."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = resp.text.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f[len("data: "):]) for f in frames[:-2]]


def test_completion_text_prompt(make, tok):
    client, backend = make()
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
    assert body["choices"] == [{"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop"}]
    n_out = len(tok.encode(TEXT)) + 1  # the eos counts as a completion token but is not text
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_out,
                             "total_tokens": len(ids) + n_out, "prompt_tokens_details": {"cached_tokens": 3},
                             "pd": {"p_cached_tokens": 3, "d_cached_tokens": 1, "transferred_tokens": 5,
                                    "transfer_error": None, "prefill_instance": "prefill-0", "local_prefill": False}}
    assert backend.closed_early == []


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_completion_token_id_prompt(make, prompt):
    client, backend = make(finish="length", final=[])
    r = client.post("/v1/completions", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    assert backend.calls[0][1] == [5, 6, 7]
    assert backend.calls[0][2] == SamplingSpec(final_only=True)  # defaults: 16 tokens, temperature 1
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_single_string_in_list(make, tok):
    client, backend = make()
    assert client.post("/v1/completions", json={"prompt": ["abc"]}).status_code == 200
    assert backend.calls[0][1] == tok.encode("abc")


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_equals_non_stream(make, include_usage):
    client, backend = make()
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


def test_chat(make, tok):
    client, backend = make()
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
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["prompt_tokens"] == len(expected)
    # Without max_tokens, chat may use the rest of the context (OpenAI / vLLM).
    client.post("/v1/chat/completions", json={"messages": messages})
    assert backend.calls[1][2].max_tokens == MAX_LEN - len(expected)


def test_chat_stream(make):
    client, _ = make()
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
def test_stop_string(make, stream, stop):
    client, backend = make()
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


def test_stop_string_never_streamed_in_part(make, tok):
    # "ld, h" spans several tokens: no streamed piece may carry its beginning.
    client, _ = make()
    events = sse_events(client.post("/v1/completions", json={"prompt": "x", "stop": "ld, h", "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello wor"


def _bad(client, path, body, status=400):
    r = client.post(path, **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] is None
    return err


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
    ({"prompt": "a", "temperature": -0.1}, "temperature", ["temperature", ">= 0"]),
    ({"prompt": "a", "top_p": 0}, "top_p", ["top_p", "(0, 1]"]),
    ({"prompt": "a", "top_p": 1.5}, "top_p", ["top_p"]),
    ({"prompt": "a", "top_k": -2}, "top_k", ["top_k"]),
    ({"prompt": "a", "n": 2}, "n", ["n must be 1"]),
    ({"prompt": "a", "echo": True}, "echo", ["echo"]),
    ({"prompt": "a", "logprobs": 1}, "logprobs", ["logprobs"]),
    ({"prompt": "a", "stop": 3}, "stop", ["stop"]),
    ({"prompt": "a", "stream": "yes please"}, "stream", ["stream"]),
])
def test_completion_400(make, body, param, words):
    client, backend = make()
    err = _bad(client, "/v1/completions", body)
    assert err["param"] == param
    assert all(w in err["message"] for w in words), err["message"]
    assert backend.calls == []


@pytest.mark.parametrize("body,param,words", [
    ({"model": MODEL}, "messages", ["'messages'", "required"]),
    ({"messages": []}, "messages", ["messages is empty"]),
    ({"messages": [{"role": "user"}]}, "messages", ["'messages.0.content' is a required field"]),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", ["messages.0.content"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", ["max_completion_tokens must be at least 1"]),
])
def test_chat_400(make, body, param, words):
    client, backend = make()
    err = _bad(client, "/v1/chat/completions", body)
    assert err["param"] == param
    assert all(w in err["message"] for w in words), err["message"]
    assert backend.calls == []


def test_context_length(make):
    client, backend = make()
    err = _bad(client, "/v1/completions", {"prompt": list(range(10)), "max_tokens": MAX_LEN - 9})
    assert err["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens. However, "
                                     f"you requested {MAX_LEN + 1} tokens (10 in the prompt, {MAX_LEN - 9} "
                                     "for the completion)")
    err = _bad(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * MAX_LEN}]})
    assert "in the messages" in err["message"]
    assert client.post("/v1/completions", json={"prompt": list(range(10)),
                                                "max_tokens": MAX_LEN - 10}).status_code == 200
    assert len(backend.calls) == 1


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "a"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})])
def test_unknown_model_404(make, path, body):
    client, _ = make()
    err = _bad(client, path, {**body, "model": "gpt-9"}, status=404)
    assert err["param"] == "model" and "gpt-9" in err["message"] and MODEL in err["message"]


def test_backend_error_status(make):
    client, _ = make(error=BackendError("no decode instance is healthy", status=503, kind="service_unavailable"))
    for stream in (False, True):  # before the first chunk the status survives in streaming too
        r = client.post("/v1/completions", json={"prompt": "a", "stream": stream})
        assert r.status_code == 503
        assert r.json() == {"error": {"message": "no decode instance is healthy", "type": "service_unavailable",
                                      "param": None, "code": None}}


def test_backend_error_mid_stream(make):
    client, backend = make(error=BackendError("decode-0 died", status=502, kind="server_error"), error_after=3)
    r = client.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == {"error": {"message": "decode-0 died", "type": "server_error", "param": None, "code": None}}
    assert all("choices" in e for e in events[:-1]) and len(events) > 1


def test_unexpected_error_is_500(make):
    client, _ = make(error=RuntimeError("boom"))
    r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 500
    assert "boom" in r.json()["error"]["message"] and r.json()["error"]["type"] == "server_error"
    events = sse_events(make(error=RuntimeError("boom"), error_after=2)[0].post(
        "/v1/completions", json={"prompt": "a", "stream": True}))
    assert "boom" in events[-1]["error"]["message"]


def test_health_and_models(make):
    client, backend = make()
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "instances": {"prefill-0": True, "decode-0": True}}
    backend.instances["decode-0"] = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["instances"]["decode-0"] is False
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"


@contextmanager
def serve_in_thread(app):
    """Runs `app` under uvicorn on a free 127.0.0.1 port; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


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
def test_client_request_id_header(make, path, body, prefix):
    client, backend = make()
    r = client.post(path, json=body, headers={"X-Request-Id": "job-42"})
    assert r.status_code == 200, r.text
    assert backend.calls[0][0] == r.json()["id"] == prefix + "job-42"


@pytest.mark.parametrize("value", ["x" * 129, "tab\there"])
def test_bad_request_id_header_is_400(make, value):
    client, backend = make()
    r = client.post("/v1/completions", json={"prompt": [5]}, headers={"X-Request-Id": value})
    assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    assert backend.calls == []


def test_sse_events_are_ascii_so_unicode_line_breaks_do_not_split_them():
    import json

    from pdcluster.router.openai_api import _event

    text = "a\u2028b\x85c\u00e9"
    line = _event({"choices": [{"text": text}]})
    assert line.isascii() and line.endswith("\n\n") and line.count("\n") == 2
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


@pytest.mark.parametrize("seed", range(20))
def test_detokenizer_in_any_batches_gives_the_whole_decode(tok, seed):
    from pdcluster.router.text_codec import Detokenizer as _Detokenizer

    rng = random.Random(seed)
    # Random ids split UTF-8 characters across tokens, and may end inside one.
    ids = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 80))]
    detok, text, i = _Detokenizer(tok), "", 0
    while i < len(ids):
        n = rng.randrange(1, 5)
        text += detok.add(ids[i:i + n], final=i + n >= len(ids))
        assert not text.endswith("\ufffd") or i + n >= len(ids), "a split character came out early"
        i += n
    assert text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(10))
def test_prompt_tokenizer_equals_the_tokenizers_encode(tok, seed):
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok)
    rng = random.Random(seed)
    pieces = ["Hello", " world", "\n\n", "  ", "é", "你好", "\u2028", "<|endoftext|>", "<|im_start|>", "user",
              "123", "!?", "\t", tok.decode(rng.randrange(3, len(tok)))]
    text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
    assert asyncio.run(prompts.text(text)) == tok.encode(text)
    tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)  # HF calls between ours
    assert asyncio.run(prompts.text(text)) == tok.encode(text)


def test_long_prompts_are_tokenized_off_the_event_loop(tok):
    import threading

    from pdcluster.router.text_codec import INLINE_TOKENIZE_CHARS
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok)
    threads = []
    encode = prompts._encode
    prompts._encode = lambda text: threads.append(threading.current_thread().name) or encode(text)
    short, long = "Once upon a time", "Once upon a time, " * (INLINE_TOKENIZE_CHARS // 10)
    messages = [{"role": "user", "content": long}]

    async def main():
        return await prompts.text(short), await prompts.text(long), await prompts.chat(messages)

    got_short, got_long, got_chat = asyncio.run(main())
    assert got_short == tok.encode(short) and got_long == tok.encode(long)
    assert got_chat == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    assert threads[0] == threading.current_thread().name and threads[1].startswith("tokenize")


def test_long_prompts_in_flight_together_are_tokenized_at_once(tok):
    """Two long prompts are encoded in two threads at the same time: each encode waits at a
    barrier that opens only when both are inside, so one thread at a time would time out."""
    import threading

    from pdcluster.router.text_codec import INLINE_TOKENIZE_CHARS
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok, threads=2)
    both_inside = threading.Barrier(2, timeout=10)
    encode = prompts._encode

    def encode_when_both_inside(text: str) -> list[int]:
        both_inside.wait()
        return encode(text)

    prompts._encode = encode_when_both_inside
    texts = [f"Prompt {i}: " + "once upon a time, " * (INLINE_TOKENIZE_CHARS // 10) for i in range(2)]

    async def main():
        return await asyncio.gather(*(prompts.text(t) for t in texts))

    assert asyncio.run(main()) == [tok.encode(t) for t in texts]


def test_tokenize_stall_bench_runs(tok_dir, tok):
    import uvloop

    from pdcluster.bench.tokenize_stall import InstantBackend, burst, long_prompt, measure

    text, n_tokens = long_prompt(tok, 8000)
    assert abs(n_tokens - 8000) < 200
    app = build_app(InstantBackend(len(tok)), tok_dir)
    stall = uvloop.run(measure(app, text))
    assert stall.long_ms > 0 and stall.short_served > 0 and stall.short_p50_ms <= stall.short_max_ms
    assert uvloop.run(burst(app, [f"{i} {text}" for i in range(3)])) > 0
