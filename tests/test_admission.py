"""Admission control (router/admission.py): the decision on hand-made numbers, then overload
through the router's HTTP API over fake engines: the excess gets a 429 at once, every accepted
request is served."""

from __future__ import annotations

import asyncio
import gc
import time

import httpx
import pytest
from dispatch_fakes import CARD, HANG, PROMPT, SAMPLING, FakeEngine, collect, engine_ids, make, run
from e2e import wait_until
from router_fakes import serve_in_thread

from pdcluster.proto.messages import DecodeDelta
from pdcluster.proto.router_spec import AdmissionSpec
from pdcluster.router.admission import AdmissionLimits, admit
from pdcluster.router.backend import BackendError
from pdcluster.router.openai_api import build_app

LIMITS = AdmissionLimits(max_in_flight=4, max_queue_s=10.0)


def test_in_flight_bound_is_exact():
    assert admit(LIMITS, 3, 0.0) is None
    refused = admit(LIMITS, 4, 0.0)
    assert refused.reason == "in_flight" and "4 requests in flight" in refused.message and refused.retry_after_s == 1


def test_queue_bound_is_exact_and_retry_after_is_the_wait_in_whole_seconds():
    assert admit(LIMITS, 0, 10.0) is None
    refused = admit(LIMITS, 0, 12.2)
    assert refused.reason == "queue" and refused.retry_after_s == 3 and "12 s" in refused.message
    assert admit(LIMITS, 0, 10.01).retry_after_s == 1  # never 0: "retry now" would be a busy loop


def test_in_flight_is_checked_before_the_queue():
    assert admit(LIMITS, 4, 99.0).reason == "in_flight"


def test_defaults_follow_the_cluster():
    assert AdmissionLimits.settle(AdmissionSpec(), decode_slots=128, request_timeout_s=300) == AdmissionLimits(256, 150)
    assert AdmissionLimits.settle(AdmissionSpec(max_in_flight=7, max_queue_s=2), 128, 300) == AdmissionLimits(7, 2)


def test_a_refused_request_reaches_no_engine_and_is_counted():
    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d], admission=AdmissionLimits(max_in_flight=1, max_queue_s=10))
    heard = []
    disp.rejection_listeners.append(heard.append)

    async def main():
        first = disp.generate("r0", PROMPT, SAMPLING)
        await first.__anext__()  # r0 is in flight
        with pytest.raises(BackendError) as ei:
            await collect(disp, "r1")
        assert ei.value.status == 429 and ei.value.retry_after_s == 1 and ei.value.kind == "rate_limit_exceeded"
        assert [c async for c in first][-1].finish_reason == "length"
        assert len(await collect(disp, "r2")) == 3  # r0 done: room again

    run(main())
    assert heard == ["in_flight"]
    assert [r.request_id for r in d.decode_calls] == engine_ids(disp, 0, 1)  # r1 took no engine id
    assert disp.accepted_in_flight == 0


def test_a_full_prefill_queue_is_refused_with_the_wait():
    p = FakeEngine()
    disp = make([p], [FakeEngine()], admission=AdmissionLimits(max_in_flight=100, max_queue_s=1.0))
    disp.picker._load["prefill-0"].seconds = 3.5  # as if P had 3.5 s of predicted prefill queued
    with pytest.raises(BackendError) as ei:
        run(collect(disp))
    assert ei.value.status == 429 and ei.value.retry_after_s == 3 and p.prefill_calls == []


class SlowDecode(FakeEngine):
    """Decodes each request for `hold_s` before its last token: accepted requests stay in flight."""

    def __init__(self, hold_s: float):
        super().__init__()
        self.hold_s = hold_s

    def call(self, method, req):
        call = super().call(method, req)
        if method == "decode":
            hold, nxt = self.hold_s, call.next

            async def slow_next():
                item = await nxt()
                if item is not None and item.finish_reason is not None:
                    await asyncio.sleep(hold)
                return item

            call.next = slow_next
        return call


def test_overload_4x_the_bound_at_once_the_excess_is_429_within_100_ms_and_the_rest_served(tok, tok_dir):
    bound = 8
    disp = make([FakeEngine()], [SlowDecode(hold_s=1.5)], timeout=30,
                admission=AdmissionLimits(max_in_flight=bound, max_queue_s=100))
    with serve_in_thread(build_app(disp, tok_dir)) as url:

        async def one(client, i):
            t0 = time.monotonic()
            r = await client.post(f"{url}/v1/completions", json={"prompt": [5, 6, i], "max_tokens": 3})
            return r, time.monotonic() - t0

        async def main():
            limits = httpx.Limits(max_connections=4 * bound)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client:
                await client.get(f"{url}/health")
                return await asyncio.gather(*(one(client, i) for i in range(4 * bound)))

        gc.freeze()  # as the router process does once started (router/server.py): a full collection
        try:         # over this test process's heap (torch, transformers) takes ~200 ms
            results = asyncio.run(main())
        finally:
            gc.unfreeze()
    ok = [(r, s) for r, s in results if r.status_code == 200]
    refused = [(r, s) for r, s in results if r.status_code == 429]
    assert len(ok) == bound and len(refused) == 3 * bound, [r.status_code for r, _ in results]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r, _ in ok)
    for r, took_s in refused:
        assert took_s < 0.1, f"a 429 took {took_s * 1e3:.0f} ms"
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_exceeded" and "in flight" in r.json()["error"]["message"]
    assert all(s >= 1.5 for _, s in ok)  # the accepted ones were in flight while the rest came


def test_a_429_from_the_router_reaches_the_openai_client_as_a_rate_limit_error(tok, tok_dir):
    import openai

    disp = make([FakeEngine()], [FakeEngine(decode_script=[DecodeDelta([10], finish_reason="length")])],
                admission=AdmissionLimits(max_in_flight=1, max_queue_s=100))
    disp.accepted_in_flight = 1  # as if one request were in flight
    with serve_in_thread(build_app(disp, tok_dir)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.RateLimitError, match="in flight"):
            client.completions.create(model=CARD.name, prompt=[5, 6], max_tokens=2)


def test_a_long_text_prompt_is_refused_before_it_is_tokenized(tok, tok_dir, monkeypatch):
    """Issue 26 item 5: under overload the 429s for long text prompts came after 0.9-6.3 s, each
    tokenized first. One request in flight of max 1: a 2 MB prompt is refused untokenized."""
    from pdcluster.router import text_codec

    tokenized = []

    async def text(self, text):
        tokenized.append("text")
        return [5]

    async def chat(self, messages):
        tokenized.append("chat")
        return [5]

    monkeypatch.setattr(text_codec.PromptTokenizer, "text", text)
    monkeypatch.setattr(text_codec.PromptTokenizer, "chat", chat)
    disp = make([FakeEngine()], [FakeEngine()], admission=AdmissionLimits(max_in_flight=1, max_queue_s=100))
    disp.accepted_in_flight = 1  # as if one request were in flight
    with serve_in_thread(build_app(disp, tok_dir)) as url, httpx.Client(timeout=30) as client:
        for path, body in (("/v1/completions", {"prompt": "word " * 400_000, "max_tokens": 3}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400_000}]})):
            r = client.post(url + path, json=body)
            assert r.status_code == 429 and "in flight" in r.json()["error"]["message"], r.text
        disp.accepted_in_flight = 0
        assert client.post(url + "/v1/completions", json={"prompt": "word", "max_tokens": 3}).status_code == 200
    assert tokenized == ["text"]  # the one admitted


@pytest.mark.parametrize("stream", [False, True])
def test_clients_that_leave_are_let_go_and_free_their_slots(tok_dir, cancelled, stream):
    """Issue 26 item 4: a non-streaming request whose client closed its connection kept
    generating, a streaming one ran until its first token, and eight clients that sent and
    left filled max_in_flight=8 (the next got a 429). Now each is aborted on P or D within 1 s
    and its slot is free."""
    bound = 8
    # Non-streaming: D hangs after a first token. Streaming: P never answers (no first token).
    p = FakeEngine(prefill_outcome=HANG) if stream else FakeEngine()
    d = FakeEngine(decode_script=[DecodeDelta([10]), HANG])
    disp = make([p], [d], timeout=60, admission=AdmissionLimits(max_in_flight=bound, max_queue_s=100))
    records = []
    disp.sinks.append(records.append)
    with serve_in_thread(build_app(disp, tok_dir)) as url:
        for i in range(bound):
            with pytest.raises(httpx.TimeoutException):  # the client gives up and closes its connection
                httpx.post(f"{url}/v1/completions", timeout=0.3,
                           json={"prompt": [5, 6, i], "max_tokens": 50, "stream": stream})
        wait_until(lambda: disp.accepted_in_flight == 0 and len(cancelled) == bound, 1.5, interval=0.02,
                   what="every request that lost its client aborted")
        assert [c for c in (p.prefill_pending if stream else d.decode_pending) if c not in cancelled] == []
        assert [r.error for r in records] == ["cancelled: the client went away or stopped reading"] * bound
        p.prefill_outcome, d.decode_script = None, None
        r = httpx.post(f"{url}/v1/completions", timeout=10, json={"prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200, r.text  # the ninth client is admitted
