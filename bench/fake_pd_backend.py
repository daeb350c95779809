"""An instant OpenAI-compatible P or D server, for measuring HTTP P/D proxies' own overhead.

It answers at once, so a proxy in front of it is measured, not an engine. Raw
asyncio + httptools (+ uvloop): a FastAPI fake would cost as much CPU per
request as the proxies it serves, on a 2-core machine that also runs them.

What it answers (what vllm-router and vLLM's toy P/D proxy send):
- POST /v1/completions and /v1/chat/completions: `max_tokens` tokens (" x"
  each), finish_reason "length"; JSON, or SSE (chunked, one event per token,
  a usage event if `stream_options.include_usage`, then [DONE]) if `stream`.
  A request carrying `kv_transfer_params` with `do_remote_decode` (the P leg of
  a NIXL-style P/D request) gets `kv_transfer_params` back as a vLLM P with
  NixlConnector answers: what D would pull, by engine id, host, port, blocks.
- any GET (/health, /v1/models, ...): 200 with a small JSON body.
Keep-alive HTTP/1.1; `Connection: close` is honoured.

usage: python -m pdcluster.bench.fake_pd_backend --port 8100 [--host 127.0.0.1] [--name fake-p] [--log-requests]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from dataclasses import dataclass

import httptools

TOKEN_TEXT = " x"


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes
    chunks: tuple[bytes, ...] | None = None  # set: sent with Transfer-Encoding: chunked, one chunk each


def remote_prefill_params(engine_id: str, port: int, request_no: int, prompt_blocks: int = 1) -> dict:
    """What a vLLM P with NixlConnector returns for D: where to pull the prompt's blocks from."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(range(prompt_blocks)),
            "remote_engine_id": engine_id, "remote_request_id": f"fake-{request_no}",
            "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1}


def completion_answer(body: dict, chat: bool, request_no: int, engine_id: str, port: int) -> Answer:
    """The instant answer to one completion request (pure)."""
    n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    model = body.get("model") or "fake"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-fake-{request_no}"
    kind = "chat.completion" if chat else "text_completion"
    prompt_tokens = 8
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
             "prompt_tokens_details": {"cached_tokens": 0}}
    kv_in = body.get("kv_transfer_params") or {}
    kv_out = remote_prefill_params(engine_id, port, request_no) if kv_in.get("do_remote_decode") else None
    if not body.get("stream"):
        choice = {"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        choice |= ({"message": {"role": "assistant", "content": TOKEN_TEXT * n}} if chat else {"text": TOKEN_TEXT * n})
        out = {"id": rid, "object": kind, "created": 0, "model": model, "choices": [choice], "usage": usage}
        if kv_out is not None:
            out["kv_transfer_params"] = kv_out
        return Answer(200, "application/json", json.dumps(out).encode())
    events = []
    for i in range(n):
        delta = ({"role": "assistant", "content": TOKEN_TEXT} if i == 0 else {"content": TOKEN_TEXT}) if chat else None
        choice = {"index": 0, "logprobs": None, "finish_reason": "length" if i == n - 1 else None}
        choice |= {"delta": delta} if chat else {"text": TOKEN_TEXT}
        events.append({"id": rid, "object": kind + ".chunk" if chat else kind, "created": 0, "model": model,
                       "choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({"id": rid, "object": kind + ".chunk" if chat else kind, "created": 0, "model": model,
                       "choices": [], "usage": usage})
    chunks = tuple(f"data: {json.dumps(e)}\n\n".encode() for e in events) + (b"data: [DONE]\n\n",)
    return Answer(200, "text/event-stream", b"", chunks)


def encode_response(answer: Answer, keep_alive: bool) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(answer.status, "Error")
    head = [f"HTTP/1.1 {answer.status} {reason}", f"content-type: {answer.content_type}",
            f"connection: {'keep-alive' if keep_alive else 'close'}"]
    if answer.chunks is None:
        head.append(f"content-length: {len(answer.body)}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + answer.body
    head.append("transfer-encoding: chunked")
    parts = [("\r\n".join(head) + "\r\n\r\n").encode()]
    for c in answer.chunks:
        parts.append(b"%x\r\n%s\r\n" % (len(c), c))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


class _Connection(asyncio.Protocol):
    def __init__(self, server: FakeServer):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body = b"", []

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(encode_response(Answer(400, "text/plain", b"bad request"), keep_alive=False))
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self):
        self.url, self.body = b"", []

    def on_url(self, url: bytes):
        self.url += url

    def on_body(self, body: bytes):
        self.body.append(body)

    def on_message_complete(self):
        keep_alive = self.parser.should_keep_alive()
        self.transport.write(encode_response(self.server.answer(self.parser.get_method(), self.url,
                                                                b"".join(self.body)), keep_alive))
        if not keep_alive:
            self.transport.close()


class FakeServer:
    def __init__(self, name: str, port: int, log_requests: bool = False):
        self.name, self.port = name, port
        self.log_requests = log_requests
        self._request_no = itertools.count()

    def answer(self, method: bytes, url: bytes, body: bytes) -> Answer:
        path = url.split(b"?", 1)[0]
        if self.log_requests:  # to see what a proxy sends (slow: for checking, not measuring)
            print(f"{self.name} {method.decode()} {url.decode()} {body[:400].decode(errors='replace')}", flush=True)
        if method == b"GET":
            return Answer(200, "application/json", json.dumps(
                {"status": "ok", "object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            try:
                req = json.loads(body)
            except ValueError:
                return Answer(400, "application/json", b'{"error": {"message": "malformed JSON"}}')
            return completion_answer(req, path == b"/v1/chat/completions", next(self._request_no), self.name,
                                     self.port)
        return Answer(404, "application/json", b'{"error": {"message": "not found"}}')


async def serve(host: str, port: int, name: str, log_requests: bool = False) -> None:
    server = FakeServer(name, port, log_requests)
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: _Connection(server), host, port, backlog=1024, reuse_address=True)
    print(f"fake {name} serving on http://{host}:{port}", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--log-requests", action="store_true", help="print each request (for checking a proxy)")
    a = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # plain asyncio: slower, still correct
        pass
    asyncio.run(serve(a.host, a.port, a.name, a.log_requests))


if __name__ == "__main__":
    main()
