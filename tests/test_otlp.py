"""Issue 28 item 7: each request's phases as OpenTelemetry spans (router/otlp.py), sent by the real
OTLP/HTTP exporter to an in-process receiver that decodes them as a collector does; the client's
`traceparent` continued; through the router's HTTP API too."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_timeline_views import T, make_record

from pdcluster.router.otlp import OtlpSpans, valid_traceparent

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Receiver:
    """An OTLP/HTTP traces endpoint on a free port: every span it was sent."""

    def __init__(self):
        self.spans: list = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    receiver.spans += [(service, s) for ss in rs.scope_spans for s in ss.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def served(request_id: str, **fields):
    return make_record(request_id, {"arrival": 0, "dispatch": 1, "p_queued": 2, "p_scheduled": 4, "p_done": 24,
                                    "d_queued": 26, "transfer_start": 27, "transfer_end": 31, "d_kv_ready": 32,
                                    "d_scheduled": 33, "d_first_token": 38, "first_token": 40, "last_token": 100,
                                    "finish": 101},
                       [40, 45, 55, 60, 70, 90, 100], prefill_instance="P0", decode_instance="D0", prompt_tokens=100,
                       p_cached_tokens=20, transferred_tokens=80, finish_reason="length", **fields)


def test_a_requests_phases_are_spans_under_one_in_the_clients_trace(receiver):
    spans = OtlpSpans(receiver.url, "tiny-qwen3", "pd-test")
    spans.observe(served("cmpl-1", traceparent=TRACEPARENT))
    spans.observe(served("chatcmpl-2"))  # no traceparent: a trace of its own
    assert spans.flush()
    spans.close()
    got = [s for _, s in receiver.spans]
    assert {service for service, _ in receiver.spans} == {"pd-test"}
    roots = {s.attributes[next(i for i, a in enumerate(s.attributes) if a.key == "gen_ai.response.id")].value
             .string_value: s for s in got if s.name.endswith("tiny-qwen3")}
    one, two = roots["cmpl-1"], roots["chatcmpl-2"]
    assert one.name == "text_completion tiny-qwen3" and two.name == "chat tiny-qwen3"
    assert one.trace_id.hex() == TRACE_ID and one.parent_span_id.hex() == PARENT_ID  # continued
    assert two.trace_id.hex() != TRACE_ID and not two.parent_span_id
    attrs = {a.key: a.value for a in one.attributes}
    assert attrs["gen_ai.usage.input_tokens"].int_value == 100 and attrs["gen_ai.usage.output_tokens"].int_value == 7
    assert attrs["gen_ai.request.model"].string_value == "tiny-qwen3"
    assert attrs["pdc.prefill_instance"].string_value == "P0" and attrs["pdc.transferred_tokens"].int_value == 80
    phases = sorted((s for s in got if s.parent_span_id == one.span_id), key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in phases] == ["router", "to_p", "p_queue", "prefill", "handoff", "d_queue", "transfer", "d_kv_wait",
                                        "first_decode", "return", "decode"]
    assert all(s.trace_id == one.trace_id for s in phases)
    prefill = next(s for s in phases if s.name == "prefill")
    assert prefill.end_time_unix_nano - prefill.start_time_unix_nano == 20 * 1_000_000  # 4 -> 24 ms
    assert one.start_time_unix_nano <= phases[0].start_time_unix_nano and one.end_time_unix_nano >= phases[-1].end_time_unix_nano
    # The wall clock: the record's router-monotonic arrival moved by wall - monotonic.
    assert abs(one.start_time_unix_nano - (T + time.time_ns() - time.monotonic_ns())) < 10**9


def test_a_failed_request_is_an_error_span(receiver):
    spans = OtlpSpans(receiver.url, "m")
    spans.observe(make_record("cmpl-x", {"arrival": 0, "dispatch": 1, "finish": 5},
                              error="prefill of cmpl-x on P0 timed out after 9 s"))
    spans.close()
    (_, root), = [(sv, s) for sv, s in receiver.spans if s.name == "text_completion m"]
    assert root.status.code == 2 and "timed out" in root.status.message  # STATUS_CODE_ERROR


@pytest.mark.parametrize("header, kept", [
    (TRACEPARENT, True), (TRACEPARENT.upper(), True), ("00-" + "0" * 32 + f"-{PARENT_ID}-01", False),
    ("garbage", False), (None, False), (f"00-{TRACE_ID}-{PARENT_ID}", False)])
def test_only_a_w3c_traceparent_is_kept(header, kept):
    assert (valid_traceparent(header) is not None) == kept


def test_the_routers_api_passes_the_clients_traceparent_on(fake_router):
    """Through the HTTP app: a valid header reaches the backend (which keeps it in the request's
    record, router/pd_dispatch.py, the spans' sink reading it there); an invalid one does not."""
    client, backend = fake_router()
    for header, want in ((TRACEPARENT, TRACEPARENT), ("not-a-traceparent", None)):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2},
                        headers={"traceparent": header})
        assert r.status_code == 200, r.text
        assert backend.traceparents[-1] == want
