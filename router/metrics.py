"""Prometheus metrics of the router, fed by finished request records.

A private registry per router (not prometheus_client's global one), so several
routers in one process (tests) do not collide. Served at GET /metrics; with several
router processes (router.processes), any one of them serves the sum of all
(`merge_expositions`), since a scrape reaches whichever the kernel picks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdcluster.proto.messages import RefusalCounts, TierCounts
from pdcluster.router.attribution import CRITICAL_PATH, attribute
from pdcluster.router.timeline import RequestRecord

# Seconds, from sub-millisecond steps to the tens of seconds a C90 128K load waits.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


def prediction_outcome(predicted: int, delivered: int) -> str:
    """exact, over (the index expected blocks the cache no longer held) or under."""
    return "exact" if predicted == delivered else "over" if predicted > delivered else "under"


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, in_flight: Callable[[], dict[str, int]],
                 pending_blocks: Callable[[str], int] | None = None, http_refused: Callable[[], int] = lambda: 0,
                 tier_blocks: Callable[[str], tuple[int, int]] | None = None):
        """`pending_blocks`: an instance's blocks pending in the router (router/pending_blocks.py);
        `http_refused`: this router's HTTP refusals (router/http_app.py HttpApp.refused);
        `tier_blocks`: an instance's host KV tier as its events say, (blocks held, blocks evicted)."""
        self.registry = r = CollectorRegistry()
        r.register(_Merged(lambda: [refused_family({("router", "http"): http_refused()})]))
        if tier_blocks is not None:
            r.register(_Merged(lambda: tier_families({name: tier_blocks(name) for name in in_flight()})))
        self.requests = Counter("pdc_requests", "requests finished, by outcome", ["outcome"], registry=r)
        self.phase = Histogram("pdc_ttft_phase_seconds", "TTFT critical-path parts (router/attribution.py)",
                               ["phase"], buckets=BUCKETS, registry=r)
        self.ttft = Histogram("pdc_ttft_seconds", "time to first token at the router", buckets=BUCKETS, registry=r)
        self.itl = Histogram("pdc_inter_token_seconds", "gap between output tokens at the router",
                             buckets=BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdc_prompt_tokens", "prompt tokens", registry=r)
        self.cached = Counter("pdc_cached_tokens", "prompt tokens a prefix cache held", ["side"], registry=r)
        self.tier_hits = Counter("pdc_tier_hit_tokens", "of the cached prompt tokens, those an instance loaded from "
                                 "its KV tier (docs/kv_tiers.md)", ["side", "tier"], registry=r)
        self.predicted = Counter("pdc_predicted_cached_tokens",
                                 "prompt tokens the router's prefix index expected a prefix cache to hold",
                                 ["side"], registry=r)
        self.predicted_pending = Counter("pdc_predicted_pending_tokens",
                                         "of P's predicted cached tokens, those only pending (routed, not yet "
                                         "confirmed by KV events)", registry=r)
        self.predictions = Counter("pdc_hit_predictions", "predicted vs delivered prefix hits, per request",
                                   ["side", "outcome"], registry=r)
        self.transferred_tokens = Counter("pdc_transferred_tokens", "prompt tokens whose KV moved P -> D",
                                          registry=r)
        self.transfer_bytes = Counter("pdc_transfer_bytes", "KV bytes moved P -> D", ["group"], registry=r)
        self.prefills = Counter("pdc_prefills", "requests' prefills by where they ran (local: on their D, "
                                "router/local_prefill.py) and the decision's reason, per D",
                                ["decode", "where", "reason"], registry=r)
        self.rejected = Counter("pdc_rejected", "requests refused with a 429 (router/admission.py), by reason",
                                ["reason"], registry=r)
        self.migrations = Counter("pdc_migrations", "requests moved off an instance lost under them "
                                  "(router/migration.py), by the lost instance's role", ["role"], registry=r)
        self.record_failures = Counter("pdc_record_failures", "records a sink could not take (a full disk, "
                                       "permissions): the requests were served all the same", ["sink"], registry=r)
        for reason in ("in_flight", "queue"):
            self.rejected.labels(reason=reason)  # every reason shows, at 0 until one happens
        for role in ("prefill", "decode"):
            self.migrations.labels(role=role)  # as the reasons: a dashboard's panel reads 0, not "no data"
        # Each labels() call takes a lock and a dict lookup (~1.3 us); a request touches ~15 children.
        self._outcome = {o: self.requests.labels(outcome=o) for o in ("ok", "error")}
        self._phase = {name: self.phase.labels(phase=name) for name in CRITICAL_PATH}
        sides = ("prefill", "decode")
        self._cached = {side: self.cached.labels(side=side) for side in sides}
        self._host_tier = {side: self.tier_hits.labels(side=side, tier="host") for side in sides}  # 0 without one
        self._pool = self.tier_hits.labels(side="decode", tier="pool")  # read from a P's tier (local prefills)
        self._predicted = {side: self.predicted.labels(side=side) for side in sides}
        self._predictions = {(side, o): self.predictions.labels(side=side, outcome=o)
                             for side in sides for o in ("exact", "over", "under")}
        in_flight_gauge = Gauge("pdc_in_flight", "requests in flight per instance (on D: sequences, n per request)",
                               ["instance"], registry=r)
        for name in in_flight():
            in_flight_gauge.labels(instance=name).set_function(lambda name=name: in_flight().get(name, 0))
        if pending_blocks is not None:
            pending_gauge = Gauge("pdc_pending_blocks", "prompt blocks routed to an instance and not yet confirmed "
                                  "by its KV events", ["instance"], registry=r)
            for name in in_flight():
                pending_gauge.labels(instance=name).set_function(lambda name=name: pending_blocks(name))

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def record_failed(self, sink: str) -> None:
        self.record_failures.labels(sink=sink).inc()

    def observe(self, rec: RequestRecord) -> None:
        self._outcome["error" if rec.error else "ok"].inc()
        att = attribute(rec)
        for name, part_ns in att.parts_ns.items():
            self._phase[name].observe(part_ns / 1e9)
        if att.ttft_ns is not None:
            self.ttft.observe(att.ttft_ns / 1e9)
        for a, b in zip(rec.token_ns, rec.token_ns[1:]):
            self.itl.observe((b - a) / 1e9)
        self.prompt_tokens.inc(rec.prompt_tokens)
        self._cached["prefill"].inc(rec.p_cached_tokens)
        self._cached["decode"].inc(rec.d_cached_tokens)
        if rec.p_tier_tokens:
            self._host_tier["prefill"].inc(rec.p_tier_tokens)
        if rec.d_tier_tokens:
            self._host_tier["decode"].inc(rec.d_tier_tokens)
        if rec.pool_tokens:
            self._pool.inc(rec.pool_tokens)
        for side, predicted, delivered in (("prefill", rec.predicted_p_hit_tokens, rec.p_cached_tokens),
                                           ("decode", rec.predicted_d_hit_tokens, rec.d_cached_tokens)):
            if predicted is not None and not rec.error:
                self._predicted[side].inc(predicted)
                self._predictions[side, prediction_outcome(predicted, delivered)].inc()
        if rec.predicted_p_pending_tokens and not rec.error:
            self.predicted_pending.inc(rec.predicted_p_pending_tokens)
        if rec.prefill_reason is not None and rec.decode_instance:
            self.prefills.labels(decode=rec.decode_instance, where="local" if rec.local_prefill else "remote",
                                 reason=rec.prefill_reason).inc()
        self.transferred_tokens.inc(rec.transferred_tokens)
        for m in rec.migrations:
            self.migrations.labels(role=m.role).inc()
        for g in rec.transfer_groups:
            self.transfer_bytes.labels(group=str(g.group)).inc(g.bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


REFUSED_HELP = ("peers refused at a plane without the cluster secret or a valid key, or malformed (the router's "
                "HTTP; each instance's planes, transfer/refusal_counts.py PLANES), since it started")


# Families every router reads off the same KV events: merged as their largest, not summed.
SAME_IN_EVERY_ROUTER = ("pdc_tier_blocks", "pdc_tier_evicted_blocks")


def tier_families(blocks: dict[str, tuple[int, int]]) -> list[Metric]:
    """pdc_tier_blocks (held) and pdc_tier_evicted_blocks_total per instance's host tier, in blocks."""
    held = GaugeMetricFamily("pdc_tier_blocks", "KV blocks an instance's host tier holds, by its events "
                             "(docs/kv_tiers.md)", labels=["instance", "tier"])
    evicted = CounterMetricFamily("pdc_tier_evicted_blocks", "KV blocks an instance's host tier evicted, by its "
                                  "events since the router's index of it began", labels=["instance", "tier"])
    for name, (n_held, n_evicted) in sorted(blocks.items()):
        held.add_metric([name, "host"], n_held)
        evicted.add_metric([name, "host"], n_evicted)
    return [held, evicted]


# The instances' own counts of their host tiers (proto/messages.py TierCounts): (family, help, field).
_TIER_COUNTS = (
    ("pdc_tier_bytes", "bytes an instance's host tier holds, as it counts them", "held_bytes"),
    ("pdc_tier_loaded_blocks", "KV blocks an instance's host tier copied back to its device cache", "loaded_blocks"),
    ("pdc_tier_loaded_bytes", "bytes an instance's host tier copied back to its device cache", "loaded_bytes"),
    ("pdc_tier_load_seconds", "time an instance's worker spent issuing its host tier's loads", "load_seconds"),
    ("pdc_tier_stored_blocks", "KV blocks an instance copied out to its host tier", "stored_blocks"),
    ("pdc_tier_stored_bytes", "bytes an instance copied out to its host tier", "stored_bytes"),
    ("pdc_tier_served_blocks", "KV blocks an instance's host tier offered to peers' reads (the pool)", "served_blocks"),
)


def tier_counts_page(counts: dict[str, TierCounts]) -> bytes:
    """The instances' tiers as they count themselves (instance name -> counts), as a page for merging."""
    families = []
    for name, help_text, attr in _TIER_COUNTS:
        fam = (GaugeMetricFamily if attr == "held_bytes" else CounterMetricFamily)(
            name, help_text + " (docs/kv_tiers.md)", labels=["instance", "tier"])
        for instance, c in sorted(counts.items()):
            fam.add_metric([instance, "host"], getattr(c, attr))
        families.append(fam)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(lambda: families))
    return generate_latest(registry)


def refused_family(counts: dict[tuple[str, str], int]) -> CounterMetricFamily:
    """pdc_refused_total: (instance, plane) -> count."""
    fam = CounterMetricFamily("pdc_refused", REFUSED_HELP, labels=["instance", "plane"])
    for (instance, plane), n in sorted(counts.items()):
        fam.add_metric([instance, plane], n)
    return fam


def refusals_page(counts: dict[str, RefusalCounts]) -> bytes:
    """The instances' refusals (instance name -> counts) as an exposition page, for merging."""
    family = refused_family({(name, plane): n for name, c in counts.items() for plane, n in asdict(c).items()})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(lambda: [family]))
    return generate_latest(registry)


class _Merged:
    """A collector that yields the metric families a callable gives, as they are (for rendering them)."""

    def __init__(self, families: Callable[[], list[Metric]]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families()


def merge_expositions(pages: list[bytes]) -> bytes:
    """Several routers' /metrics pages as one: each series summed over the routers (counts,
    sums, buckets, and the in-flight gauges, whose instances' requests are split between
    routers), except `_created` timestamps, which keep the earliest."""
    families: dict[str, Metric] = {}
    series: dict[str, dict[tuple[str, tuple], float]] = {}  # family -> (sample name, labels) -> value
    for page in pages:
        for fam in text_string_to_metric_families(page.decode()):
            families.setdefault(fam.name, fam)
            own = series.setdefault(fam.name, {})
            for sample in fam.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = own.get(key)
                own[key] = sample.value if old is None else (
                    min(old, sample.value) if sample.name.endswith("_created")
                    else max(old, sample.value) if fam.name in SAME_IN_EVERY_ROUTER else old + sample.value)
    for name, fam in families.items():
        fam.samples = [Sample(sample_name, dict(labels), value) for (sample_name, labels), value in series[name].items()]
    registry = CollectorRegistry(auto_describe=False)
    merged = list(families.values())
    registry.register(_Merged(lambda: merged))
    return generate_latest(registry)
