"""The router's HTTP layer: a small ASGI app (served by uvicorn) with exact-path routes.

The router's own work per request is a few hundred microseconds; FastAPI's middleware
stack, dependency solving and request objects added ~250 us to it (bench/README.md, router
overhead), so the router speaks ASGI directly. Only what the router needs is here:
- routes by method and exact path; an unknown path is a 404, a known path with another
  method a 405, both with OpenAI's error body;
- a request's body read whole before its handler runs, within `HttpLimits`: over
  `max_body_bytes` it is a 413 (from Content-Length, before any of it is read), not
  complete within `body_timeout_s` a 408;
- a handler returns `BytesResponse` (JSON via `json_response`) or `StreamResponse`;
- optional API keys (`require_api_keys`): a request without `Authorization: Bearer <a key>`
  gets a 401 before its body is read, on every path but /health (vLLM's `--api-key` guards
  /v1 only; /tokenize and /metrics cost and show as much) and /metrics where the spec opens it.

A `StreamResponse` closes its chunk iterator when it ends, however it ends (done, failed,
the client went away, or it stopped reading for `stall_s`): closing runs the iterator's
`finally`, which is where the backend's request is aborted and its record written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdcluster.proto.router_spec import HttpLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes


@dataclass(frozen=True)
class BytesResponse:
    body: bytes
    status: int = 200
    media_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    async def send(self, send: Callable, receive: Callable) -> None:
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", self.media_type.encode("latin-1")),
                                (b"content-length", str(len(self.body)).encode("latin-1")),
                                *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items())]})
        await send({"type": "http.response.body", "body": self.body})


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> BytesResponse:
    # As Starlette's JSONResponse: compact, UTF-8; NaN is not JSON and fails here, not in a client.
    return BytesResponse(json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(),
                         status, headers=headers or {})


@dataclass(frozen=True)
class StreamResponse:
    chunks: AsyncIterator[str]
    media_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)
    stall_s: float = HttpLimits.stall_s  # HttpApp sets its own limit

    async def send(self, send: Callable, receive: Callable) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", self.media_type.encode("latin-1")),
                                    *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items())]})
            # The body is written while another task waits for the client to go away;
            # whichever ends first cancels the other.
            pump = asyncio.ensure_future(self._pump(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait((pump, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, gone):
                    task.cancel()
                for task in (gone, pump):  # the pump last: its error, if any, is the response's
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        finally:
            await aclose(self.chunks)

    async def _pump(self, send: Callable) -> None:
        # uvicorn's send waits while the client's socket takes nothing (flow control); past
        # stall_s the pump ends, and with it the request.
        try:
            async for chunk in self.chunks:
                async with asyncio.timeout(self.stall_s):
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        except TimeoutError:
            log.warning("a streaming client took nothing for %.0f s: its request is ended", self.stall_s)
            return  # send's finally closes the chunks: the backend aborts and records it
        await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def aclose(it: Any) -> None:
    """Close an async iterator (run its `finally`), even from a cancelled task: the backend's
    cleanup (aborting the request on P and D) must get to run."""
    if getattr(it, "ag_frame", True) is None:  # an async generator that ended: nothing to run
        return  # (the common case; shield() would cost a Task per request)
    if hasattr(it, "aclose"):
        await asyncio.shield(it.aclose())


Response = BytesResponse | StreamResponse
Handler = Callable[[HttpRequest], Awaitable[Response]]


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class BodyRefused(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


async def _read_body(receive: Callable, limits: HttpLimits) -> bytes:
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ConnectionError("the client went away while sending its request")
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > limits.max_body_bytes:  # chunked, or a Content-Length that lied
                    raise BodyRefused(f"the request body is over {limits.max_body_bytes} bytes", 413)
                if not message.get("more_body"):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
    except TimeoutError:
        raise BodyRefused(f"the request body did not arrive within {limits.body_timeout_s:g} s", 408) from None


def _declared_length(scope: dict) -> int | None:
    value = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    return int(value) if value is not None and value.isdigit() and len(value) < 20 else None


class HttpApp:
    """An ASGI app: `add(method, path, handler)`, then serve it with uvicorn."""

    def __init__(self, limits: HttpLimits = HttpLimits()) -> None:
        self.limits = limits
        self.routes: dict[tuple[str, str], Handler] = {}
        self._api_keys: tuple[bytes, ...] = ()  # empty: no key asked for
        self._open_paths: frozenset[str] = frozenset()
        # Requests answered 401 (no valid key), and connections closed before their headers
        # (router/http_protocol.py): the router's /metrics counts them.
        self.refused = 0

    def add(self, method: str, path: str, handler: Handler) -> None:
        assert (method, path) not in self.routes, f"{method} {path} is routed twice"
        self.routes[(method, path)] = handler

    def require_api_keys(self, keys: list[str], open_paths: tuple[str, ...] = ("/health",)) -> None:
        """From now on, every path but `open_paths` answers 401 without `Authorization: Bearer
        <one of keys>`: /tokenize, /detokenize and the router's own pages spend its CPU and show
        what it serves as much as /v1 does."""
        assert all(keys), "an empty API key would let anyone in"
        self._api_keys = tuple(f"Bearer {k}".encode("latin-1") for k in keys)
        self._open_paths = frozenset(open_paths)

    def refused_one(self) -> None:
        self.refused += 1

    def _authorized(self, scope: dict) -> bool:
        if not self._api_keys or scope["path"] in self._open_paths:
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        # Every key compared, in constant time: how long a refusal takes says nothing of the keys.
        return sum(hmac.compare_digest(given, key) for key in self._api_keys) > 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served; uvicorn closes the connection
        method, path = scope["method"], scope["path"]
        if not self._authorized(scope):
            self.refused_one()
            await json_response({"error": {"message": "a valid API key is needed: Authorization: Bearer <key>",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}, 401).send(send, receive)
            return
        handler = self.routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self.routes):
                response = json_response(error_body(f"method {method} not allowed on {path}",
                                                    "invalid_request_error"), 405)
            else:
                response = json_response(error_body(f"no route {path}", "not_found_error"), 404)
            await response.send(send, receive)
            return
        declared = _declared_length(scope)
        try:
            if declared is not None and declared > self.limits.max_body_bytes:  # refused unread
                raise BodyRefused(f"the request body is {declared} bytes, over the limit of "
                                  f"{self.limits.max_body_bytes}", 413)
            body = await _read_body(receive, self.limits)
        except ConnectionError:
            return
        except BodyRefused as e:
            await json_response(error_body(str(e), "invalid_request_error"), e.status).send(send, receive)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        response = await _unless_gone(handler(HttpRequest(method, path, headers, body)), receive)
        if response is None:
            return
        if isinstance(response, StreamResponse):
            response = dataclasses.replace(response, stall_s=self.limits.stall_s)
        await response.send(send, receive)


async def _unless_gone(answer, receive: Callable) -> Response | None:
    """The handler's response; None, with the handler cancelled (which aborts its request on
    the engines and frees its admission slot), if the client disconnects first: a client gone
    before its answer or its first streamed token no longer holds its request. The handler runs
    in this task; a watcher task, started only once the handler has run WATCH_AFTER_S, cancels it
    (a task per request cost the router ~10% of its throughput on instant engines)."""
    me, gone, watcher = asyncio.current_task(), False, None

    async def watch() -> None:
        nonlocal gone
        await _disconnected(receive)
        gone = True
        me.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(watch())

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, start_watching)
    try:
        response = await answer
    except asyncio.CancelledError:
        if not gone:
            raise
        me.uncancel()
        return None
    finally:
        timer.cancel()
        if watcher is not None:  # an unfinished receive() consumes nothing: the response's own watch takes over
            watcher.cancel()
    if gone:  # answered as the client left, its cancel still pending: no await here; end a stream's iterator
        me.uncancel()
        if isinstance(response, StreamResponse):
            closing = asyncio.ensure_future(aclose(response.chunks))
            _CLOSING.add(closing)
            closing.add_done_callback(_CLOSING.discard)
        return None
    return response


WATCH_AFTER_S = 0.05  # a handler that answers sooner never pays for a disconnect watch
_CLOSING: set[asyncio.Future] = set()  # iterators being closed for clients gone (held until done)


async def _lifespan(receive: Callable, send: Callable) -> None:
    # Nothing to start or stop: the router's resources live in its actor.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
