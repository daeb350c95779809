"""The router's HTTP connections before they are requests (router/http_protocol.py, issue 26): a
connection that sends nothing or trickles its headers is closed at the header deadline, one past
the connection cap at once, both counted; requests that keep to them are served as before."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from e2e import wait_until

from pdcluster.router.http_app import HttpApp, json_response
from pdcluster.router.http_protocol import FD_HEADROOM, bounded_http, connection_cap

HEADER_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def server():
    app = HttpApp()

    async def hello(request):
        return json_response({"ok": True})

    app.add("GET", "/hello", hello)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", http=bounded_http(HEADER_TIMEOUT_S, MAX_CONNECTIONS,
                                                                        app.refused_one))
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 10, interval=0.02, what="uvicorn started")
    yield sock.getsockname(), app, srv
    srv.should_exit = True
    thread.join(10)
    sock.close()


def closed_within(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_silent_connection_is_closed_at_the_header_deadline_and_counted(server):
    address, app, _ = server
    before = app.refused
    t0 = time.monotonic()
    with socket.create_connection(address) as conn:
        assert closed_within(conn, 5)
    # Not before its deadline. libuv (uvloop) times from the loop's cached clock, in ms: it fired
    # 0.14 ms short of 0.5 s once in a clean-clone run; 10 ms is that clock's slack, not a deadline's.
    assert time.monotonic() - t0 >= HEADER_TIMEOUT_S - 0.01
    wait_until(lambda: app.refused == before + 1, 2, interval=0.01, what="the close counted")


def test_headers_trickled_a_byte_at_a_time_do_not_keep_a_connection(server):
    address, _, _ = server
    request = b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 400
    closed = False
    with socket.create_connection(address) as conn:
        for byte in request:  # a byte every 50 ms (20 s in all): data keeps coming, the headers never end
            try:
                conn.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed or closed_within(conn, 0.05):
                closed = True
                break
    assert closed, "a connection trickling its headers was kept for 20 s"


def test_requests_that_keep_to_the_deadline_are_served_on_a_kept_alive_connection(server):
    address, _, _ = server
    with httpx.Client(base_url=f"http://{address[0]}:{address[1]}") as client:
        for _ in range(3):
            assert client.get("/hello").json() == {"ok": True}
            time.sleep(HEADER_TIMEOUT_S / 2)  # idle, not slow headers: the same connection serves on
    with socket.create_connection(address) as conn:  # the second request's headers are held to it too
        conn.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(5)
        assert b"200 OK" in conn.recv(4096)
        conn.sendall(b"GET /hello HTTP/1.1\r\n")
        assert closed_within(conn, 5)


def test_a_connection_past_the_cap_is_closed_at_once_and_the_router_serves_when_they_go(server):
    address, app, srv = server
    held = [socket.create_connection(address) for _ in range(MAX_CONNECTIONS)]
    try:
        wait_until(lambda: len(srv.server_state.connections) == MAX_CONNECTIONS, 5, interval=0.01,
                   what="the server holding every connection")
        before = app.refused
        with socket.create_connection(address) as extra:
            assert closed_within(extra, 0.3)  # at once, long before the header deadline
        assert app.refused == before + 1
    finally:
        for conn in held:
            conn.close()
    wait_until(lambda: httpx.get(f"http://{address[0]}:{address[1]}/hello", timeout=2).status_code == 200, 5,
               what="served again once the held connections closed")


def test_the_cap_stays_below_the_file_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 4096))
    assert connection_cap(4096) == 1024 - FD_HEADROOM
    assert connection_cap(100) == 100
