"""Two floors under the router's overhead (router_overhead.py), to say where its time is not.

1. **uvicorn alone**: uvicorn, as the router runs it (httptools, uvloop, no access log),
   serving an ASGI app that answers every request at once with a fixed completion; wrk
   at 32 and 1 connections, its process's CPU a request. Plain process, then the same
   server in a Ray actor (the router is one).
2. **the router's Python, in-process**: the router's OpenAI app (router/openai_api.py) over
   the real PDDispatcher, whose request channels are replaced by in-process ones that
   answer at once; each request is one ASGI call in a loop, after a warm-up. Recording
   (metrics and a run directory) on and off. No HTTP server, no sockets: what is left is
   parsing, tokenizing, routing, dispatch, records and the response.

usage: python -m pdcluster.bench.router_floors [--duration 5] [--requests 5000] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pdcluster.bench.instant_engine import instant_deltas, instant_prefill
from pdcluster.bench.wrk_load import cpu_seconds, free_port, request_body, run_wrk, wait_http, wrk_script

ANSWER = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "text": " x x x x", "logprobs": None, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}}).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def instant_app(scope, receive, send) -> None:
    """An ASGI app that reads the body and answers ANSWER."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def uvicorn_config(port: int):
    import uvicorn

    return uvicorn.Config(instant_app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                          proxy_headers=False)


class UvicornActor:
    """uvicorn in a Ray actor's event loop, as RouterActor runs it."""

    async def start(self, port: int) -> int:
        import uvicorn

        self.server = uvicorn.Server(uvicorn_config(port))
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.05)
        return os.getpid()


def measure_http(name: str, url: str, pid: int, script: Path, duration_s: float) -> None:
    for connections in (32, 1):
        cpu0 = cpu_seconds([pid])
        load = run_wrk(url, script, connections, duration_s)
        cpu = cpu_seconds([pid]) - cpu0
        print(f"| {name} | {connections} | {load.rps:,.0f} | {load.p50_ms:.2f} | {cpu / load.requests * 1e6:.0f} |",
              flush=True)


def uvicorn_floor(duration_s: float, model: str) -> None:
    import subprocess

    import ray

    script = Path(tempfile.mkdtemp(prefix="router-floors-")) / "plain.lua"
    script.write_text(wrk_script(request_body(model, stream=False)))
    print("| uvicorn + instant ASGI app | connections | req/s | p50 ms | server CPU us/req |")
    print("|---|---|---|---|---|")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.bench.router_floors", "--serve", str(port)])
    try:
        wait_http(f"http://127.0.0.1:{port}/", 30, proc)
        measure_http("plain process", f"http://127.0.0.1:{port}/v1/completions", proc.pid, script, duration_s)
    finally:
        proc.terminate()
        proc.wait(10)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="pdcluster-bench")
    try:
        actor = ray.remote(UvicornActor).options(num_cpus=0, max_concurrency=1000).remote()
        port = free_port()
        pid = ray.get(actor.start.remote(port))
        measure_http("in a Ray actor", f"http://127.0.0.1:{port}/v1/completions", pid, script, duration_s)
    finally:
        ray.shutdown()


# ---- the router's Python, in-process ---------------------------------------------------------------

class InstantCall:
    """A request-channel call whose replies are all here already (request_channel.PendingCall's interface)."""

    def __init__(self, items: list):
        self.items = list(items)

    @property
    def done(self) -> bool:
        return not self.items

    @property
    def has_reply(self) -> bool:
        return not self.done

    async def next(self):
        return self.items.pop(0) if self.items else None

    def cancel(self) -> None:
        self.items.clear()


class InstantChannel:
    """An engine's request channel answering at once, as the overhead benchmark's InstantEngine does."""

    def call(self, method: str, req) -> InstantCall:
        return InstantCall([instant_prefill(req)] if method == "prefill" else instant_deltas(req))


def in_process_app(model_dir: str, recording: bool):
    from pdcluster.router.backend import ModelCard
    from pdcluster.router.metrics import RouterMetrics
    from pdcluster.router.openai_api import build_app
    from pdcluster.router.pd_dispatch import Instance, PDDispatcher
    from pdcluster.router.run_store import RunMeta, RunStore

    config = json.loads((Path(model_dir) / "config.json").read_text())
    p, d = Instance("prefill-0", None), Instance("decode-0", None)
    dispatcher = PDDispatcher([p], [d], ModelCard(Path(model_dir).name, 4096, config["vocab_size"]), 30,
                              channels={p.name: InstantChannel(), d.name: InstantChannel()})
    if recording:
        metrics = RouterMetrics(lambda: dispatcher.in_flight)
        store = RunStore(tempfile.mkdtemp(prefix="router-floors-run-"), RunMeta("floors", 0, 0, {}, {}, []))
        dispatcher.sinks += [metrics.observe, store.append]
    return build_app(dispatcher, model_dir)


async def asgi_requests(app, body: bytes, n: int) -> float:
    """n requests, one after another; seconds a request."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    status: list[int] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    t0 = time.perf_counter()
    for _ in range(n):
        request = [{"type": "http.request", "body": body, "more_body": False}]
        await app(scope, lambda: _pop(request), send)
    elapsed = time.perf_counter() - t0
    assert status == [200] * n, f"failed requests: {[s for s in status if s != 200][:5]}"
    return elapsed / n


async def _pop(request: list[dict]) -> dict:
    return request.pop() if request else await asyncio.Event().wait()


def in_process_floor(model_dir: str, n: int) -> None:
    import uvloop

    body = json.dumps(request_body(Path(model_dir).name, stream=False)).encode()
    print("| the router's app, in-process | recording | us a request (median of 3) |")
    print("|---|---|---|")
    for recording in (True, False):
        app = in_process_app(model_dir, recording)
        uvloop.run(asgi_requests(app, body, n))  # warm-up: the first thousands run slower
        runs = sorted(uvloop.run(asgi_requests(app, body, n)) for _ in range(3))
        print(f"| instant in-process engines | {'on' if recording else 'off'} | {runs[1] * 1e6:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    ap.add_argument("--requests", type=int, default=5000, help="in-process requests per measurement")
    ap.add_argument("--model-dir", default=".pdcluster/models/tiny-qwen3")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: be the plain uvicorn process
    a = ap.parse_args()
    if a.serve:
        import uvicorn

        uvicorn.Server(uvicorn_config(a.serve)).run()
        return
    model_dir = str(Path(a.model_dir).resolve())
    in_process_floor(model_dir, a.requests)
    uvicorn_floor(a.duration, Path(model_dir).name)


if __name__ == "__main__":
    main()
