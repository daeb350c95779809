"""The router's HTTP front end over a scripted fake backend: what its unit tests share.

`fake_router(**FakeBackend kwargs)` (a fixture, as `tok` and `tok_dir`: tests/conftest.py imports them) gives a Starlette TestClient on `build_app` and the
backend; `serve_in_thread` runs the app under a real uvicorn for clients that need sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from pdcluster.cluster.tiny_model import make_tiny_model
from pdcluster.proto.messages import SamplingSpec, TokenLogprobs
from pdcluster.router.backend import GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.openai_api import build_app
from pdcluster.router.openai_models import PdUsage

MODEL = "tiny"
MAX_LEN = 64
TEXT = "Hello world, héllo 你好 the end."


def fake_logprobs(token_id: int, top: int) -> TokenLogprobs:
    """A position as vLLM's engine gives it: the sampled token, then `top` alternatives by rank
    (the sampled one among them at rank 2, so it appears once); the last alternative is -inf."""
    alternatives = [token_id + 1, token_id, *range(token_id + 2, token_id + top)][:top]
    logprobs = [-1.0 - i / 4 for i in range(len(alternatives))]
    if alternatives:
        logprobs[-1] = float("-inf")
    ranked = dict(zip(alternatives, logprobs))
    rank = {t: i + 1 for i, t in enumerate(alternatives)}
    sampled = ranked.pop(token_id, -1.5)
    return TokenLogprobs((token_id, *ranked), (sampled, *ranked.values()),
                         (rank.get(token_id, top + 7), *(rank[t] for t in ranked)))


class FakeBackend(TokenBackend):
    """Yields `script` (token ids, one chunk each) then a final chunk (with `fake_logprobs` when
    asked); records calls and early closes."""

    def __init__(self, vocab_size: int, script: list[int], final: list[int], finish: str = "stop",
                 error: Exception | None = None, error_after: int = 0, delay: float = 0.0):
        self.card = ModelCard(name=MODEL, max_model_len=MAX_LEN, vocab_size=vocab_size)
        self.script, self.final, self.finish = script, final, finish
        self.error, self.error_after, self.delay = error, error_after, delay
        self.calls: list[tuple[str, list[int], SamplingSpec]] = []
        self.traceparents: list[str | None] = []  # each call's, as the front end passed it
        self.closed_early: list[str] = []  # request ids whose iterator was closed before the end
        self.instances = {"prefill-0": True, "decode-0": True}

    def model_card(self) -> ModelCard:
        return self.card

    async def generate(self, request_id, prompt_token_ids, sampling, arrival_ns=None, traceparent=None):
        self.calls.append((request_id, list(prompt_token_ids), sampling))
        self.traceparents.append(traceparent)
        done = False
        try:
            n = sampling.n  # n > 1: each choice's tokens in turn, the script's for each
            for i, t in enumerate(self.script):
                if self.error is not None and i == self.error_after:
                    raise self.error
                await asyncio.sleep(self.delay)
                for index in range(n):
                    yield GenerationChunk([t], logprobs=self._logprobs([t], sampling), index=index)
            for index in range(n - 1):
                yield GenerationChunk(self.final, None, None, self._logprobs(self.final, sampling), index=index,
                                      choice_finish=self.finish)
            yield GenerationChunk(self.final, self.finish, PdUsage(p_cached_tokens=3, d_cached_tokens=1,
                                                                   transferred_tokens=5, prefill_instance="prefill-0"),
                                  self._logprobs(self.final, sampling), self._prompt_logprobs(prompt_token_ids, sampling),
                                  index=n - 1, choice_finish=self.finish if n > 1 else None)
            done = True
        finally:  # closed (GeneratorExit) or cancelled (CancelledError) before the end
            if not done and self.error is None:
                self.closed_early.append(request_id)

    async def health(self):
        return dict(self.instances)

    @staticmethod
    def _prompt_logprobs(prompt: list[int], sampling: SamplingSpec) -> tuple[TokenLogprobs | None, ...]:
        if sampling.prompt_logprobs is None:
            return ()
        return (None, *(fake_logprobs(t, sampling.prompt_logprobs) for t in prompt[1:]))

    @staticmethod
    def _logprobs(tokens: list[int], sampling: SamplingSpec) -> tuple[TokenLogprobs, ...]:
        if sampling.logprobs is None:
            return ()
        return tuple(fake_logprobs(t, 8 if sampling.logprobs == -1 else sampling.logprobs) for t in tokens)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture
def fake_router(tok, tok_dir):
    """fake_router(**backend kwargs) -> (TestClient, FakeBackend); by default it generates TEXT then eos."""

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


def bad_request(client, path, body, status=400):
    r = client.post(path, **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] is None
    return err


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
