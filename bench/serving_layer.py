"""Issue 30's design question, measured: the CPU one plain completion costs in vLLM's own OpenAI
serving layer against the router's own layer, both in this process, in front of an engine that
answers at once (no HTTP, no P/D dispatch, no records: what the two layers do differently).

- **vLLM**: the installed vLLM's `OpenAIServingCompletion.create_completion` as `vllm serve` builds
  it (request model, renderer and tokenizer, sampling params, response), over an `EngineClient`
  whose `generate` yields one finished `RequestOutput` with its text already in it: vLLM's engine
  client detokenizes in its output processor, so that cost is left out of vLLM's side.
- **pdcluster**: the router's `/v1/completions` handler (router/openai_api.py: body parse and
  validation, tokenizer, sampling checks, the job, detokenizing the answer, the response) over a
  `TokenBackend` that yields the same 4 tokens at once.

The same body (a ~12-token text prompt, 4 tokens out, temperature 0), the same tokenizer (the tiny
model's), `--requests` each, alternating for `--rounds`: CPU microseconds a request
(time.process_time: every thread of the process) and the response's bytes.

Written against vLLM 0.32's modules (the renderers and `OnlineRenderer`); other versions lay
them out otherwise (tests/test_serving_layer_bench.py runs it on the installed one).

usage: python -m pdcluster.bench.serving_layer [--model DIR] [--requests 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from pdcluster.proto.messages import SamplingSpec
from pdcluster.router.backend import GenerationChunk, ModelCard, TokenBackend
from pdcluster.router.http_app import HttpRequest
from pdcluster.router.openai_api import build_app
from pdcluster.router.openai_models import PdUsage

BODY = {"model": "tiny", "prompt": "hello there, how are you doing on this fine day", "max_tokens": 4,
        "temperature": 0}
OUT_TOKENS = [40, 41, 42, 43]


class _Instant(TokenBackend):
    def model_card(self) -> ModelCard:
        return ModelCard("tiny", 2048, 4096)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                       arrival_ns: int | None = None, traceparent: str | None = None) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk(OUT_TOKENS, "length", PdUsage(p_cached_tokens=0, d_cached_tokens=0, transferred_tokens=0))


def ours(model: str):
    app = build_app(_Instant(), model)
    handler = app.routes[("POST", "/v1/completions")]
    body = json.dumps(BODY).encode()

    async def one() -> int:
        response = await handler(HttpRequest("POST", "/v1/completions", {"content-type": "application/json"}, body))
        assert response.status == 200, response.body
        return len(response.body)
    return one


def vllms(model: str):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.v1.engine.input_processor import InputProcessor

    config = EngineArgs(model=model, max_model_len=2048, enforce_eager=True).create_engine_config()
    renderer = renderer_from_config(config)
    text = renderer.tokenizer.decode(OUT_TOKENS)

    class InstantClient:  # the EngineClient members the completion path reads
        vllm_config, model_config = config, config.model_config
        input_processor = InputProcessor(config, renderer)
        errored, dead_error = False, None

        def __init__(self):
            self.renderer = renderer

        def check_admission(self, n: int) -> None:
            pass

        async def abort(self, request_id) -> None:
            pass

        async def notify_kv_transfer_request_rejected(self, *args, **kwargs) -> None:
            pass

        async def generate(self, prompt, params, request_id, **kwargs):
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.prompt_token_ids
            yield RequestOutput(request_id, None, ids, None,
                                [CompletionOutput(0, text, OUT_TOKENS, None, None, finish_reason="length")],
                                True, num_cached_tokens=0)

    registry = OpenAIModelRegistry(model_config=config.model_config,
                                   base_model_paths=[BaseModelPath(name="tiny", model_path=model)])
    online = OnlineRenderer(config.model_config, renderer, request_logger=None, chat_template=None,
                            chat_template_content_format="auto")
    serving = OpenAIServingCompletion(InstantClient(), registry, online_renderer=online, request_logger=None)
    body = json.dumps(BODY).encode()

    async def one() -> int:
        response = await serving.create_completion(CompletionRequest.model_validate_json(body))
        return len(response.model_dump_json())
    return one


async def measure_cpu(one, n: int, warm: int = 50) -> tuple[float, Any]:
    """This process's CPU time (every thread) per call of `one`, in us, over `n` calls after
    `warm` (first calls compile, cache, import); and what the last warm call returned."""
    for _ in range(warm):
        size = await one()
    c0 = time.process_time()
    for _ in range(n):
        await one()
    return (time.process_time() - c0) / n * 1e6, size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".pdcluster/models/tiny-qwen3", help="the tiny model's directory")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    layers = {"pdcluster": ours(a.model), "vLLM": vllms(a.model)}
    print(f"{'layer':10} {'round':>5} {'CPU us/request':>15} {'response bytes':>15}")
    for r in range(1, a.rounds + 1):
        for name, one in layers.items():
            us, size = asyncio.run(measure_cpu(one, a.requests))
            print(f"{name:10} {r:5} {us:15.0f} {size:15}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
