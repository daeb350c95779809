"""What a long text prompt does to the router's other requests while it is tokenized.

The router's OpenAI app (router/openai_api.py) in this process, over a backend that
answers at once, so only the router's own work is measured. One request carries a text
prompt of ~`--tokens` tokens; while it is served, short requests go one after another
and a ticker sleeps 1 ms at a time on the same event loop. Two ways, in one run:
tokenizing every prompt on the event loop, and the router's way (prompts over
INLINE_TOKENIZE_CHARS in a worker thread, the Rust tokenizer without the GIL); and, for
comparison, the same prompt sent as token ids (parsed and validated on the loop).
Then a burst: `--burst` such prompts (each its own text) sent at once, tokenized by one
worker thread and by the router's TOKENIZE_THREADS.

usage: python -m pdcluster.bench.tokenize_stall [--tokens 131072] [--burst 4] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from pdcluster.proto.messages import SamplingSpec
from pdcluster.router.backend import GenerationChunk, ModelCard, TokenBackend

CORPUS = Path(__file__).resolve().parent.parent / "cluster" / "corpus" / "serving.txt"


class InstantBackend(TokenBackend):
    """Answers every request with max_tokens copies of its first prompt id, at once."""

    def __init__(self, vocab_size: int):
        self.card = ModelCard("tiny", max_model_len=1 << 20, vocab_size=vocab_size)

    def model_card(self) -> ModelCard:
        return self.card

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                       arrival_ns: int | None = None, traceparent: str | None = None) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk([prompt_token_ids[0]] * sampling.max_tokens, finish_reason="length")


async def post(app, raw: bytes) -> float:
    """One /v1/completions request (its JSON body) through the ASGI app; its latency in seconds."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    sent: list[dict] = []
    request = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict:
        return request.pop() if request else await asyncio.Event().wait()

    async def send(message: dict) -> None:
        sent.append(message)

    t0 = time.perf_counter()
    await app(scope, receive, send)
    assert sent and sent[0]["status"] == 200, f"request failed: {sent[:2]}"
    return time.perf_counter() - t0


@dataclass
class Stall:
    long_ms: float  # the long request, arrival to answer
    max_tick_gap_ms: float  # the longest the event loop went without running the 1 ms ticker
    short_served: int  # short requests answered while the long one was in flight
    short_p50_ms: float
    short_max_ms: float


async def measure(app, long_prompt: str | list[int]) -> Stall:
    long_body = json.dumps({"prompt": long_prompt, "max_tokens": 4}).encode()  # the client's work: not timed
    short_body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4}).encode()
    done = asyncio.Event()
    gaps: list[float] = []
    shorts: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def short_requests() -> None:
        while not done.is_set():
            shorts.append(await post(app, short_body))
            await asyncio.sleep(0)  # the instant backend never waits: let the loop run the others

    async def long_request() -> float:
        await asyncio.sleep(0.05)  # the ticker and the short requests are going
        try:
            return await post(app, long_body)
        finally:
            done.set()

    long_s, *_ = await asyncio.gather(long_request(), ticker(), short_requests())
    assert gaps and shorts, "the long request ended before the ticker or a short request ran"
    return Stall(long_s * 1e3, max(gaps) * 1e3, len(shorts), statistics.median(shorts) * 1e3, max(shorts) * 1e3)


async def burst(app, prompts: list[str]) -> float:
    """All prompts at once; seconds until the last is answered."""
    bodies = [json.dumps({"prompt": p, "max_tokens": 4}).encode() for p in prompts]
    t0 = time.perf_counter()
    await asyncio.gather(*(post(app, b) for b in bodies))
    return time.perf_counter() - t0


def long_prompt(tokenizer, tokens: int) -> tuple[str, int]:
    base = CORPUS.read_text()
    per_char = len(tokenizer.encode(base)) / len(base)
    text = (base * (int(tokens / per_char / len(base)) + 1))[:int(tokens / per_char)]
    return text, len(tokenizer.encode(text))


def main() -> None:
    import uvloop
    from transformers import AutoTokenizer

    from pdcluster.router import openai_api, text_codec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--model-dir", default=".pdcluster/models/tiny-qwen3")
    ap.add_argument("--burst", type=int, default=4, help="long prompts sent at once in the burst table")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each way; the median long request is reported")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    text, n_tokens = long_prompt(tokenizer, args.tokens)
    print(f"long prompt: {len(text):,} characters, {n_tokens:,} tokens; short prompt: 4 tokens")
    print("| tokenizing | long request ms | longest event-loop stall ms | short requests served meanwhile "
          "| short p50 ms | short max ms |")
    print("|---|---|---|---|---|---|")
    inline_limit = text_codec.INLINE_TOKENIZE_CHARS
    ids = tokenizer.encode(text)
    for way, limit, prompt in (("every prompt on the event loop", len(text), text),
                               ("long ones in a worker thread", inline_limit, text),
                               ("none: the same prompt as token ids", inline_limit, ids)):
        text_codec.INLINE_TOKENIZE_CHARS = limit
        app = openai_api.build_app(InstantBackend(len(tokenizer)), args.model_dir)
        runs = sorted((uvloop.run(measure(app, prompt)) for _ in range(args.repeats)), key=lambda s: s.long_ms)
        s = runs[len(runs) // 2]
        print(f"| {way} | {s.long_ms:.0f} | {s.max_tick_gap_ms:.1f} | {s.short_served} | {s.short_p50_ms:.2f} "
              f"| {s.short_max_ms:.1f} |")
    text_codec.INLINE_TOKENIZE_CHARS = inline_limit

    texts = [f"{i} {text}" for i in range(args.burst)]  # distinct texts, so nothing could be shared
    print(f"\n{args.burst} such prompts at once ({os.cpu_count()} cores):")
    print("| tokenizer threads | all answered, s (median) | prompts/s |")
    print("|---|---|---|")
    threads = text_codec.TOKENIZE_THREADS
    for n in sorted({1, threads}):
        text_codec.TOKENIZE_THREADS = n
        app = openai_api.build_app(InstantBackend(len(tokenizer)), args.model_dir)
        s = sorted(uvloop.run(burst(app, texts)) for _ in range(args.repeats))[args.repeats // 2]
        print(f"| {n} | {s:.2f} | {args.burst / s:.1f} |")
    text_codec.TOKENIZE_THREADS = threads


if __name__ == "__main__":
    main()
