"""Each request's phases as OpenTelemetry spans, sent to an OTLP/HTTP collector (spec
`observability.otlp_endpoint`), as Dynamo and llm-d export theirs.

A record sink (router/pd_dispatch.py calls it with each finished request's record): one span for
the request, `{operation} {model}` as the GenAI semantic conventions name it (kind SERVER, from its
arrival at the router to its end), with the conventions' attributes where they fit (operation,
system, model, response id, token usage, finish reason) and pdcluster's own (`pdc.*`: the P and D
that served it, the cached and transferred tokens, an error); under it a span per phase interval
(router/attribution.py INTERVALS: the router's own time, the hop to P, P's queue, the prefill, the
KV transfer on D, D's first step, the decode, ...), each named by its phase. A client's W3C
`traceparent` header is continued: the request's span is its child, in its trace. Times are the
record's (the router's monotonic clock), mapped to the wall clock once at start. Spans leave in
batches from the SDK's own thread: a request never waits on the collector.
"""

from __future__ import annotations

import re
import time

from pdcluster.router.attribution import intervals
from pdcluster.router.timeline import RequestRecord

TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def valid_traceparent(value: str | None) -> str | None:
    """The header if it is a W3C traceparent (an invalid one is ignored, as the spec says)."""
    if value is None:
        return None
    value = value.strip().lower()
    if not TRACEPARENT.match(value) or value.split("-")[1] == "0" * 32 or value.split("-")[2] == "0" * 16:
        return None
    return value


class OtlpSpans:
    def __init__(self, endpoint: str, model: str, service_name: str = "pdcluster", exporter=None):
        """`exporter`: a SpanExporter to use instead of OTLP/HTTP at `endpoint` (tests)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdcluster.router")
        self.model = model
        self._wall_minus_mono = time.time_ns() - time.monotonic_ns()

    def observe(self, rec: RequestRecord) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ev = rec.events
        if "arrival" not in ev:
            return
        parent = (TraceContextTextMapPropagator().extract({"traceparent": rec.traceparent})
                  if rec.traceparent else None)
        operation = "chat" if rec.request_id.startswith("chatcmpl-") else "text_completion"
        end_ns = ev.get("finish") or max(ev.values())
        attrs = {"gen_ai.operation.name": operation, "gen_ai.system": "vllm", "gen_ai.request.model": self.model,
                 "gen_ai.response.id": rec.request_id, "gen_ai.usage.input_tokens": rec.prompt_tokens,
                 "gen_ai.usage.output_tokens": rec.output_tokens, "pdc.cached_tokens.prefill": rec.p_cached_tokens,
                 "pdc.cached_tokens.decode": rec.d_cached_tokens, "pdc.transferred_tokens": rec.transferred_tokens,
                 "pdc.local_prefill": rec.local_prefill}
        if rec.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [rec.finish_reason]
        for key, value in (("pdc.prefill_instance", rec.prefill_instance), ("pdc.decode_instance", rec.decode_instance)):
            if value:
                attrs[key] = value
        root = self.tracer.start_span(f"{operation} {self.model}", context=parent, kind=SpanKind.SERVER,
                                      start_time=self._wall(ev["arrival"]), attributes=attrs)
        if rec.error:
            root.set_status(Status(StatusCode.ERROR, rec.error))
            root.set_attribute("error.type", rec.error.split(":")[0][:100])
        inside = set_span_in_context(root)
        for iv in intervals(rec):
            span = self.tracer.start_span(iv.name, context=inside, start_time=self._wall(iv.start_ns),
                                          attributes={"pdc.where": iv.where})
            span.end(end_time=self._wall(max(iv.end_ns, iv.start_ns)))
        root.end(end_time=self._wall(end_ns))

    def _wall(self, mono_ns: int) -> int:
        return mono_ns + self._wall_minus_mono

    def flush(self, timeout_ms: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def close(self) -> None:
        self.provider.shutdown()
