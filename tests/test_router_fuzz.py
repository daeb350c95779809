"""A property-based fuzz of the router's HTTP API (issue 16 item 5): whatever a client sends,
the answer is a 2xx or a 4xx with an OpenAI error body whose message names the problem, never
a 500 and never a hang, and the server answers /health afterwards.

Fixed seed (derandomized) and a bounded number of cases per property in CI; a longer run:
PDC_FUZZ_EXAMPLES=20000 .venv/bin/pytest -q tests/test_router_fuzz.py
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import MAX_LEN, MODEL, FakeBackend
from starlette.testclient import TestClient

from pdcluster.proto.router_spec import HttpLimits
from pdcluster.router.openai_api import build_app
from pdcluster.router.openai_models import UNSUPPORTED

EXAMPLES = int(os.environ.get("PDC_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BODY_LIMIT = 64 * 1024
PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "user",
          "return_token_ids", "echo", "logprobs", "tokens", *UNSUPPORTED)

numbers = st.one_of(st.integers(), st.integers(min_value=-(10**40), max_value=10**40),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0, 1, -1, 2**63, 2**64, 1e308]))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=6)),
                           max_leaves=30)
token_lists = st.lists(st.integers(min_value=-5, max_value=2000), max_size=MAX_LEN + 8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 3]),
                                           "content": st.one_of(st.text(max_size=60), json_values)}), max_size=4)
plausible = {
    "model": st.one_of(st.just(MODEL), json_values),
    "prompt": st.one_of(st.text(max_size=80), token_lists, st.lists(token_lists, max_size=3), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": numbers, "max_completion_tokens": numbers, "temperature": numbers, "top_p": numbers,
    "top_k": numbers, "seed": numbers, "n": numbers,
    "stop": st.one_of(st.text(max_size=8), st.lists(st.text(max_size=8), max_size=40), json_values),
    "stop_token_ids": st.one_of(token_lists, json_values),
    "tokens": st.one_of(token_lists, json_values),  # /detokenize's
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
}
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda fields: st.fixed_dictionaries({k: plausible.get(k, json_values) for k in fields}))


@pytest.fixture(scope="module")
def client(tok, tok_dir):
    backend = FakeBackend(len(tok), tok.encode("Hi there"), [tok.eos_token_id])
    with TestClient(build_app(backend, tok_dir, HttpLimits(max_body_bytes=BODY_LIMIT)),
                    raise_server_exceptions=False) as c:
        yield c
    assert TestClient(build_app(backend, tok_dir)).get("/health").status_code == 200


def check(r) -> None:
    """2xx, or a 4xx whose OpenAI error body has a message; a 5xx is a bug."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and len(err["message"]) > 5 and err["type"], err
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"server_error"' not in r.text, r.text[-300:]


@FUZZ
@given(path=st.sampled_from(PATHS), body=bodies)
def test_random_bodies_with_wrong_types_everywhere(client, path, body):
    check(client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}))


@FUZZ
@given(path=st.sampled_from(PATHS), body=bodies, data=st.data())
def test_mutated_and_truncated_json(client, path, body, data):
    raw = bytearray(json.dumps(body).encode())
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[at:at] = data.draw(st.sampled_from([b"{", b"[", b"]", b",", b'"', b"NaN", b"\xff", b"\\u12", b"1e999"]))
        elif op == "delete" and raw:
            del raw[at]
        elif op == "truncate":
            del raw[at:]
    check(client.post(path, content=bytes(raw), headers={"content-type": "application/json"}))


@FUZZ
@given(path=st.sampled_from(PATHS), depth=st.integers(1, 5000), opener=st.sampled_from(["[", '{"a":']))
def test_deep_nesting(client, path, depth, opener):
    closer = "]" if opener == "[" else "}"
    check(client.post(path, content=f'{{"prompt": "a", "user": {opener * depth}1{closer * depth}}}'.encode()))


@FUZZ
@given(path=st.sampled_from(PATHS), name=st.sampled_from(["x-request-id", "content-type", "authorization",
                                                          "content-length", "x-anything"]),
       value=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=300))
def test_header_abuse(client, path, name, value):
    body = {"prompt": "a"} if path == PATHS[0] else {"messages": [{"role": "user", "content": "a"}]}
    raw = json.dumps(body).encode()
    if name == "content-length":  # a length that lies: the server must neither hang nor 500
        value = value if value.isascii() and value.isdigit() and int(value) <= len(raw) else str(len(raw))
    headers = {"content-type": "application/json", name: value.encode("latin-1")}  # any byte a header may hold
    check(client.post(path, content=raw, headers=headers))


def test_oversized_body_is_413(client):
    r = client.post(PATHS[0], content=b'{"prompt": "' + b"a" * (BODY_LIMIT + 1) + b'"}')
    assert r.status_code == 413 and str(BODY_LIMIT) in r.json()["error"]["message"]


@pytest.mark.parametrize("body,param", [({"prompt": "a", "n": -3}, "n"), ({"prompt": "a", "suffix": "z"}, "suffix"),
                                        ({"prompt": "a", "best_of": 2}, "best_of"),
                                        ({"messages": [{"role": "user", "content": "a"}],
                                          "tools": [{"type": "function"}]}, "tools")])
def test_unsupported_parameters_are_refused_by_name(client, body, param):
    path = PATHS[1] if "messages" in body else PATHS[0]
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
