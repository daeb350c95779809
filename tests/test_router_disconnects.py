"""Clients that leave at every stage (issue 26, items 3 and 4), fuzzed: a client sends a request
cut at any byte (in its headers, between headers and body, in its body) or whole and then reads
any number of the answer's bytes (none, the headers, part of a stream), and leaves (FIN or
RST). Whatever the stage, within 2 s nothing it asked for runs on P or D, its admission slot is
free, every request begun has its record, and the router serves the next client.

Fixed seed and a bounded number of cases in CI; a longer run:
PDC_FUZZ_EXAMPLES=2000 .venv/bin/pytest -q tests/test_router_disconnects.py
"""

from __future__ import annotations

import json
import os
import socket
import struct

import httpx
import pytest
from dispatch_fakes import HANG, FakeEngine, make
from e2e import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import serve_in_thread

from pdcluster.proto.messages import DecodeDelta
from pdcluster.router.admission import AdmissionLimits
from pdcluster.router.openai_api import build_app

EXAMPLES = max(1, int(os.environ.get("PDC_FUZZ_EXAMPLES", "150")) // 3)
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def raw_request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


REQUESTS = [raw_request(path, {**body, "stream": stream})
            for path, body in (("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 50}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 50}))
            for stream in (False, True)]


@pytest.fixture(scope="module")
def router(tok_dir):
    # P answers; D sends two tokens and then never finishes: only the client's leaving ends a request.
    p, d = FakeEngine(), FakeEngine(decode_script=[DecodeDelta([10]), DecodeDelta([11]), HANG])
    disp = make([p], [d], timeout=600, admission=AdmissionLimits(max_in_flight=4, max_queue_s=100))
    begun, records = [], []
    disp.begin_sinks.append(begun.append)
    disp.sinks.append(records.append)
    with serve_in_thread(build_app(disp, tok_dir)) as url:
        yield url, disp, (p, d), begun, records


def leave(url: str, data: bytes, read: int, reset: bool) -> None:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        sock.sendall(data)
        sock.settimeout(0.3)  # a non-streaming answer sends nothing until it ends (never, here)
        got = b""
        while len(got) < read:
            try:
                chunk = sock.recv(read - len(got))
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        if reset:  # an RST instead of a FIN: the connection aborted, as by a killed client
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@FUZZ
@given(which=st.integers(0, len(REQUESTS) - 1), cut=st.floats(0, 1), whole=st.booleans(),
       read=st.sampled_from([0, 1, 40, 200, 400, 800]), reset=st.booleans())
def test_a_client_that_leaves_at_any_stage_leaves_nothing_behind(router, which, cut, whole, read, reset):
    url, disp, engines, begun, records = router
    request = REQUESTS[which]
    leave(url, request if whole else request[:int(cut * (len(request) - 1))], read if whole else 0, reset)

    def settled() -> bool:
        calls = [c for e in engines for c in e.prefill_pending + e.decode_pending]
        return disp.accepted_in_flight == 0 and all(c.done for c in calls) and len(records) == len(begun)

    wait_until(settled, 2, interval=0.01, what="the request of a client that left, let go on P and D")
    assert {r.error for r in records} <= {"cancelled: the client went away or stopped reading"}
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
