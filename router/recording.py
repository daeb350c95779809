"""Fill a RequestRecord from what P and D report, on the router's clock.

The dispatcher calls these as results arrive; every instance timestamp goes
through that instance's ClockOffset, and a 0 (vLLM did not record it) stays
absent rather than becoming a bogus event.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdcluster.proto.messages import DecodeDelta, PrefillResult
from pdcluster.router.timeline import ClockOffset, GroupTransfer, RequestRecord

RecordSink = Callable[[RequestRecord], None]


def _mark(rec: RequestRecord, event: str, instance_ns: int, clock: ClockOffset) -> None:
    if instance_ns:
        rec.mark(event, clock.to_router(instance_ns))


def record_route(rec: RequestRecord, route, policy: str) -> None:
    """Where the router sent the request, and the hits it expected there (router/routing.py Route)."""
    rec.prefill_instance, rec.decode_instance = route.prefill.name, route.decode.name
    rec.policy = policy
    rec.predicted_p_hit_tokens, rec.predicted_d_hit_tokens = route.predicted_p_hit_tokens, route.predicted_d_hit_tokens
    rec.predicted_p_tier_tokens = route.predicted_p_tier_tokens or 0
    rec.predicted_d_tier_tokens = route.predicted_d_tier_tokens or 0
    rec.predicted_p_pending_tokens = route.predicted_p_pending_tokens
    rec.predicted_p_prefill_s = route.predicted_p_prefill_s
    if route.local is not None:
        rec.prefill_reason = route.local.reason
    if route.local_prefill:  # no P in it: nothing predicted there
        rec.local_prefill, rec.prefill_instance = True, None
        rec.predicted_p_hit_tokens = rec.predicted_p_pending_tokens = rec.predicted_p_prefill_s = None
        rec.predicted_p_tier_tokens = 0
    rec.pool_instance = route.pool.name if route.pool is not None else None
    rec.predicted_pool_tokens = route.pool_tokens


# What one attempt at a request records; a migration before the first token drops them,
# so that the record tells the attempt that produced the first token (router/migration.py).
_ATTEMPT_EVENTS = ("dispatch", "p_queued", "p_scheduled", "p_tier_loaded", "p_done", "d_queued", "d_tier_load_start",
                   "d_tier_loaded", "transfer_start", "transfer_end", "d_kv_ready", "d_scheduled", "d_first_token")


def forget_attempt(rec: RequestRecord) -> None:
    for event in _ATTEMPT_EVENTS:
        rec.events.pop(event, None)
    rec.local_prefill, rec.prefill_reason = False, None
    rec.p_cached_tokens = rec.p_tier_tokens = rec.d_cached_tokens = rec.d_tier_tokens = rec.transferred_tokens = 0
    rec.pool_tokens = 0
    rec.transfer_groups, rec.transfer_error = [], None


def record_prefill(rec: RequestRecord, pre: PrefillResult, clock: ClockOffset) -> None:
    rec.p_cached_tokens, rec.p_tier_tokens = pre.p_cached_tokens, pre.p_tier_tokens
    if pre.p_pool is not None:  # P read a peer's tier first (the route's pool)
        rec.pool_tokens = pre.p_pool_tokens
        if pre.p_pool.error:
            rec.pool_error = f"P's read from {rec.pool_instance}'s tier failed (P computed it): {pre.p_pool.error}"
    _mark(rec, "p_queued", pre.engine.queued_ns, clock)
    _mark(rec, "p_scheduled", pre.engine.scheduled_ns, clock)
    if pre.p_tier_load_ns and pre.engine.scheduled_ns:  # the load opens the first step that runs it
        _mark(rec, "p_tier_loaded", pre.engine.scheduled_ns + pre.p_tier_load_ns, clock)
    _mark(rec, "p_done", pre.engine.first_token_ns, clock)


def record_decode_end(rec: RequestRecord, last: DecodeDelta, clock: ClockOffset, pooled: bool = False) -> None:
    """From D's last delta: its engine times and its transfer report (`pooled`: its transfer was a
    read of a P's tier, the pool's)."""
    if last.engine is not None:
        _mark(rec, "d_queued", last.engine.queued_ns, clock)
        _mark(rec, "d_scheduled", last.engine.scheduled_ns, clock)
        _mark(rec, "d_first_token", last.engine.first_token_ns, clock)
    t = last.transfer
    if rec.local_prefill and last.finish_reason is not None:  # D's own hit: all the cache it had
        rec.d_cached_tokens = last.num_cached_tokens
    if t is not None:
        rec.d_cached_tokens, rec.transferred_tokens = t.d_cached_tokens, t.transferred_tokens
        rec.d_tier_tokens = t.d_tier_tokens
        if rec.local_prefill:  # D's read of a P's tier (P's own read came with P's answer)
            rec.pool_tokens = t.transferred_tokens if pooled and t.error is None else 0
        names = t.group_names if len(t.group_names) == len(t.blocks_per_group) else ("",) * len(t.blocks_per_group)
        rec.transfer_groups = [GroupTransfer(g, blocks, nbytes, name) for g, (blocks, nbytes, name)
                               in enumerate(zip(t.blocks_per_group, t.bytes_per_group, names))]
        _mark(rec, "d_tier_load_start", t.d_tier_load_start_ns, clock)
        _mark(rec, "d_tier_loaded", t.d_tier_loaded_ns, clock)
        _mark(rec, "transfer_start", t.transfer_start_ns, clock)
        _mark(rec, "transfer_end", t.transfer_end_ns, clock)
        _mark(rec, "d_kv_ready", t.kv_ready_ns, clock)
        rec.transfer_error = t.error
    rec.finish_reason = last.finish_reason


def record_tokens(rec: RequestRecord, delta: DecodeDelta, clock: ClockOffset, now_ns: int | None = None) -> None:
    """A delta's new tokens: each at its engine time if the delta says (on the router clock),
    else now (`now_ns`, by default the router's clock); the first marks first_token, every one
    last_token."""
    if not delta.new_token_ids:
        return
    now = time.monotonic_ns() if now_ns is None else now_ns
    if delta.token_ns:  # the engine batched steps: each token at its own time, on the router clock
        assert len(delta.token_ns) == len(delta.new_token_ids), "token_ns must stamp every new token"
        # Never later than now: a clock offset's error must not put a token after its arrival.
        if clock.offset_ns == 0 and delta.token_ns[-1] <= now:  # one host, times in order: as they are
            times = list(delta.token_ns)
        else:
            times = [min(now, clock.to_router(t)) for t in delta.token_ns]
    else:
        times = [now] * len(delta.new_token_ids)
    if not rec.token_ns:
        rec.mark("first_token", times[0])
    rec.token_ns.extend(times)
    rec.output_tokens = len(rec.token_ns)
    rec.mark("last_token", times[-1])
