"""The router's ASGI layer (router/http_app.py): routing, bodies, responses, closing streams."""

from __future__ import annotations

import asyncio

import pytest
from dispatch_fakes import until
from starlette.testclient import TestClient

from pdcluster.router.http_app import BytesResponse, HttpApp, HttpRequest, StreamResponse, json_response


def echo_app() -> tuple[HttpApp, list[HttpRequest]]:
    seen: list[HttpRequest] = []

    async def echo(request: HttpRequest) -> BytesResponse:
        seen.append(request)
        return json_response({"bytes": len(request.body), "id": request.headers.get("x-request-id")}, 201)

    app = HttpApp()
    app.add("POST", "/echo", echo)
    return app, seen


def test_routes_by_method_and_exact_path():
    app, seen = echo_app()
    with TestClient(app) as client:  # as a context manager: the lifespan protocol runs too
        r = client.post("/echo", content=b"x" * 10, headers={"X-Request-Id": "a1"})
        assert (r.status_code, r.json()) == (201, {"bytes": 10, "id": "a1"})
        assert r.headers["content-type"] == "application/json" and r.headers["content-length"] == str(len(r.content))
        assert seen[0].method == "POST" and seen[0].path == "/echo" and seen[0].body == b"x" * 10

        r = client.get("/echo")
        assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
        r = client.post("/echo/")
        assert r.status_code == 404 and r.json()["error"] == {"message": "no route /echo/", "type": "not_found_error",
                                                              "param": None, "code": None}
    assert len(seen) == 1


def test_api_keys_guard_every_path_but_health_and_the_open_ones():
    app, seen = echo_app()
    for path in ("/v1/echo", "/tokenize", "/metrics"):
        app.add("POST", path, app.routes[("POST", "/echo")])
    app.add("GET", "/health", lambda request: _ok())
    app.require_api_keys(["sk-one", "sk-two"])
    with TestClient(app) as client:
        for path in ("/v1/echo", "/tokenize", "/metrics", "/echo"):
            for headers in ({}, {"Authorization": "Bearer sk-three"}, {"Authorization": "sk-one"},
                            {"Authorization": "Bearer sk-one "}):
                r = client.post(path, content=b"x", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        assert seen == []  # refused before the handler (and before the body was read)
        for key in ("sk-one", "sk-two"):
            assert client.post("/tokenize", content=b"x", headers={"Authorization": f"Bearer {key}"}).status_code == 201
        assert client.get("/health").status_code == 200  # open, as vLLM's --api-key leaves it
    app.require_api_keys(["sk-one"], open_paths=("/health", "/metrics"))  # auth.open_metrics
    with TestClient(app) as client:
        assert client.post("/metrics", content=b"x").status_code == 201
        assert client.post("/tokenize", content=b"x").status_code == 401


async def _ok() -> BytesResponse:
    return json_response({"ok": True})


def test_a_body_sent_in_chunks_reaches_the_handler_whole():
    app, seen = echo_app()
    parts = [b"ab", b"cd", b""]

    def chunks():
        yield from parts

    r = TestClient(app).post("/echo", content=chunks())  # chunked transfer: several http.request messages
    assert r.json()["bytes"] == 4 and seen[0].body == b"abcd"


def test_a_route_cannot_be_added_twice():
    app, _ = echo_app()
    with pytest.raises(AssertionError, match="POST /echo is routed twice"):
        app.add("POST", "/echo", lambda request: None)


def test_json_response_refuses_nan_rather_than_sending_invalid_json():
    assert json_response({"a": "é"}).body == '{"a":"é"}'.encode()
    with pytest.raises(ValueError):
        json_response({"a": float("nan")})


class Chunks:
    """An async iterator of `n` chunks that records whether it was closed, and how far it got."""

    def __init__(self, n: int, delay: float = 0.0, fail_at: int | None = None):
        self.n, self.delay, self.fail_at = n, delay, fail_at
        self.sent, self.closed = 0, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise RuntimeError("backend failed")
                await asyncio.sleep(self.delay)
                self.sent += 1
                yield f"data: {i}\n\n"
        finally:
            self.closed = True


async def run_stream(response: StreamResponse, disconnect_after: int | None = None) -> list[dict]:
    """Drive `response` as an ASGI server would; the client goes away after `disconnect_after` body messages."""
    sent: list[dict] = []
    gone = asyncio.Event()

    async def send(message):
        sent.append(message)
        if disconnect_after is not None and sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after:
            gone.set()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    await response.send(send, receive)
    return sent


def test_a_stream_sends_every_chunk_then_closes_its_iterator():
    chunks = Chunks(3)
    it = aiter(chunks)
    sent = asyncio.run(run_stream(StreamResponse(it, headers={"cache-control": "no-cache"})))
    assert sent[0]["status"] == 200 and (b"cache-control", b"no-cache") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert chunks.closed and chunks.sent == 3


def test_a_client_that_goes_away_closes_the_stream_early():
    chunks = Chunks(1000, delay=0.01)  # 10 s if nobody stops it
    sent = asyncio.run(asyncio.wait_for(run_stream(StreamResponse(aiter(chunks)), disconnect_after=2), 5))
    assert chunks.closed and chunks.sent < 10
    assert sent[-1].get("more_body") is True  # the body was cut, never finished


def test_a_failing_iterator_is_closed_and_its_error_raised():
    chunks = Chunks(5, fail_at=2)
    with pytest.raises(RuntimeError, match="backend failed"):
        asyncio.run(run_stream(StreamResponse(aiter(chunks))))
    assert chunks.closed and chunks.sent == 2


def test_aclose_finishes_a_generators_cleanup_even_if_the_closing_task_is_cancelled():
    from pdcluster.router.http_app import aclose

    cleaned: list[str] = []

    async def gen():
        try:
            yield 1
        finally:
            await asyncio.sleep(0.05)  # as the backend's abort of P and D awaits
            cleaned.append("done")

    async def main():
        it = gen()
        await it.__anext__()
        closing = asyncio.ensure_future(aclose(it))
        await asyncio.sleep(0.01)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await until(lambda: cleaned, what="the generator's cleanup run to its end")

    asyncio.run(main())
    assert cleaned == ["done"]


def test_a_client_gone_before_its_body_arrived_runs_no_handler():
    app, seen = echo_app()
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/echo", "headers": []}
    asyncio.run(app(scope, receive, send))
    assert seen == [] and sent == []
