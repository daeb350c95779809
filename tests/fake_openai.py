"""A small OpenAI-compatible streaming server for load-driver tests (no engine).

Streams `max_tokens` token ids one chunk each after `delay_s`, reports usage with
`cached_tokens`, tracks requests in flight, and fails the requests whose index
(the first prompt token) is in `fail`: HTTP 500, or an error event mid-stream; answers
429 (Retry-After: 0) as many times as `reject` says for a request before serving it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeServerState:
    delay_s: float = 0.005
    fail_http: set[int] = field(default_factory=set)
    fail_midstream: set[int] = field(default_factory=set)
    reject: dict[int, int] = field(default_factory=dict)  # first prompt token -> 429s to answer before serving it
    cached_tokens: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    starts: dict[int, float] = field(default_factory=dict)  # first prompt token -> arrival (monotonic)


def build_fake_app(state: FakeServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "vocab_size": 1000}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        key = body["prompt"][0]
        state.starts[key] = time.monotonic()
        if state.reject.get(key, 0) > 0:
            state.reject[key] -= 1
            return JSONResponse({"error": {"message": f"request {key}: too many in flight",
                                           "type": "rate_limit_exceeded"}}, 429, headers={"Retry-After": "0"})
        if key in state.fail_http:
            return JSONResponse({"error": {"message": f"request {key} refused", "type": "server_error"}}, 500)
        n = body["max_tokens"]

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                for i in range(n):
                    await asyncio.sleep(state.delay_s)
                    if key in state.fail_midstream and i == 1:
                        yield f"data: {json.dumps({'error': {'message': f'decode of {key} failed'}})}\n\n"
                        break
                    choice = {"index": 0, "text": "x", "token_ids": [i], "finish_reason": "length" if i == n - 1 else None}
                    yield f"data: {json.dumps({'id': f'cmpl-{key}', 'choices': [choice]})}\n\n"
                else:
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                             "prompt_tokens_details": {"cached_tokens": state.cached_tokens}}
                    yield f"data: {json.dumps({'id': f'cmpl-{key}', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def serve_fake(state: FakeServerState):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_fake_app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
