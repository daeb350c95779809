"""What the model's tool and reasoning parsers (router/chat_parsers.py) cost the router a chat request.

The router's `/v1/chat/completions` handler in this process over a backend that answers at once
with the tokens of a hermes tool call (~30 tokens), so only the router's own work is measured:
the request read, the template, the job, detokenizing, and with parsers vLLM's request model,
`adjust_request`, one parser per choice and its parse. CPU microseconds a request
(time.process_time), alternating the cases for `--rounds`:

- plain chat, no parsers in the spec (the path every cluster without them runs);
- plain chat with the spec's parsers (hermes + deepseek_v3): what naming them costs every chat request;
- tools, tool_choice auto, with the parsers: the call parsed out of the answer; unstreamed and streamed.

usage: python -m pdcluster.bench.chat_parsers [--model DIR] [--requests 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator

from pdcluster.bench.serving_layer import measure_cpu
from pdcluster.proto.messages import SamplingSpec
from pdcluster.router.backend import GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.http_app import HttpRequest, StreamResponse
from pdcluster.router.openai_api import build_app
from pdcluster.router.openai_models import PdUsage

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris today?"}],
        "max_tokens": 64, "temperature": 0}


class _Instant(TokenBackend):
    def __init__(self, answer: list[int]):
        self.answer = answer

    def model_card(self) -> ModelCard:
        return ModelCard("tiny", 4096, 1009)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                       arrival_ns: int | None = None, traceparent: str | None = None) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk(self.answer, "stop", PdUsage(p_cached_tokens=0, d_cached_tokens=0, transferred_tokens=0))


def case(model: str, parsers, body: dict):
    from transformers import AutoTokenizer

    answer = AutoTokenizer.from_pretrained(model).encode(CALL)
    handler = build_app(_Instant(answer), model, parsers=parsers).routes[("POST", "/v1/chat/completions")]
    raw = json.dumps(body).encode()

    async def one() -> None:
        response = await handler(HttpRequest("POST", "/v1/chat/completions", {"content-type": "application/json"}, raw))
        if isinstance(response, StreamResponse):
            text = "".join([e async for e in response.chunks])
            assert text.endswith("data: [DONE]\n\n"), text[-200:]
        else:
            assert response.status == 200, response.body
            text = response.body.decode()
        assert ('"tool_calls"' in text) == ("tools" in body), text[:300]  # the call parsed out, or not asked for
    return one


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".pdcluster/models/tiny-qwen3", help="the tiny model's directory")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    from pdcluster.router.chat_parsers import ChatParsers

    t0 = time.perf_counter()
    parsers = ChatParsers(a.model, "hermes", "deepseek_v3", True)
    print(f"loading the parsers (vLLM's import included): {time.perf_counter() - t0:.1f} s")
    tools = {**CHAT, "tools": TOOLS}
    cases = {"plain chat, no parsers": case(a.model, None, CHAT),
             "plain chat, parsers": case(a.model, parsers, CHAT),
             "tools auto, parsers": case(a.model, parsers, tools),
             "tools auto, parsers, streamed": case(a.model, parsers, {**tools, "stream": True})}
    print(f"{'case':32} {'round':>5} {'CPU us/request':>15}")
    for r in range(1, a.rounds + 1):
        for name, one in cases.items():
            print(f"{name:32} {r:5} {asyncio.run(measure_cpu(one, a.requests, warm=30))[0]:15.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
