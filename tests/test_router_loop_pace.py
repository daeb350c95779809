"""The router's event loop belongs to everyone (issue 26 item 3): while one client sends each of
the requests that used to hold the loop for seconds (a 3 MB role, 100,000 empty messages, a
large /detokenize, a 3 MB text prompt to /tokenize, 268K stop_token_ids), another client's stream
keeps its pace: its largest gap stays under its normal gap + 100 ms. The router under a real
uvicorn; a backend that streams one token every INTERVAL_S."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx
import pytest
from router_fakes import serve_in_thread

from pdcluster.router.backend import GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.openai_api import build_app

INTERVAL_S = 0.01
MODEL = "tiny"


class PacedBackend(TokenBackend):
    """Streams `max_tokens` tokens, one every INTERVAL_S."""

    def __init__(self, vocab_size: int):
        self.card = ModelCard(name=MODEL, max_model_len=1 << 20, vocab_size=vocab_size)

    def model_card(self) -> ModelCard:
        return self.card

    async def generate(self, request_id, prompt_token_ids, sampling, arrival_ns=None, traceparent=None):
        for i in range(sampling.max_tokens):
            await asyncio.sleep(INTERVAL_S)
            yield GenerationChunk([5], "length" if i == sampling.max_tokens - 1 else None)

    async def health(self):
        return {"prefill-0": True, "decode-0": True}


def bad_bodies(tok) -> dict[str, tuple[str, bytes]]:
    """name -> (path, body): each held the loop for seconds before issue 26 (its text says how long)."""
    text = "the quick brown fox jumps over the lazy dog " * 70_000  # ~3 MB, ~630K tokens
    bodies = {
        "a 3 MB role": ("/tokenize", {"model": MODEL, "messages": [{"role": "x" * 3_000_000, "content": "hi"}]}),
        "100,000 empty messages": ("/v1/chat/completions",
                                   {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 100_000}),
        "a /detokenize of 400,000 ids": ("/detokenize", {"model": MODEL, "tokens": [tok.encode("fox")[0]] * 400_000}),
        "a 3 MB text prompt to /tokenize": ("/tokenize", {"model": MODEL, "prompt": text}),
        "268K stop_token_ids": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                    "stop_token_ids": [5] * 268_000}),
    }
    return {name: (path, json.dumps(body).encode()) for name, (path, body) in bodies.items()}


@pytest.fixture(scope="module")
def router_url(tok, tok_dir):
    with serve_in_thread(build_app(PacedBackend(len(tok)), tok_dir)) as url:
        yield url


@pytest.mark.parametrize("bad", ["a 3 MB role", "100,000 empty messages", "a /detokenize of 400,000 ids",
                                 "a 3 MB text prompt to /tokenize", "268K stop_token_ids"])
def test_another_clients_stream_keeps_its_pace_while_a_bad_request_runs(router_url, tok, bad):
    path, body = bad_bodies(tok)[bad]
    answer: dict = {}

    def send_bad() -> None:
        t0 = time.monotonic()
        r = httpx.post(router_url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        answer.update(status=r.status_code, text=r.text[:300], s=time.monotonic() - t0)

    arrivals: list[float] = []
    bad_thread = threading.Thread(target=send_bad)
    with httpx.stream("POST", router_url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 3000, "stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 30:  # its normal pace measured: the bad request starts
                bad_from = len(arrivals)
                bad_thread.start()
            elif len(arrivals) > 30 and not bad_thread.is_alive():
                bad_to = len(arrivals)
                break
    bad_thread.join()
    assert answer["status"] < 500, answer
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    normal = statistics.median(gaps[5:bad_from - 1])
    worst = max(gaps[bad_from - 1:bad_to - 1])
    print(f"{bad}: answered {answer['status']} in {answer['s']:.2f} s; the stream's gaps: normal "
          f"{normal * 1e3:.1f} ms, largest meanwhile {worst * 1e3:.1f} ms")
    assert worst < normal + 0.1, f"{bad} held the stream {worst * 1e3:.0f} ms (normal gap {normal * 1e3:.0f} ms)"
