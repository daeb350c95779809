"""Per-request timelines: what happened to each request, when, and where.

A `RequestRecord` holds every event of one request as integer nanoseconds on
ONE clock: the router's `time.monotonic_ns()`. Events measured in other
processes (vLLM's engine stats, D's KV pull) are mapped onto it with the
per-instance offset measured when the router registered that instance
(`ClockOffset`). Runs of records are written and read by router/run_store.py.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

# The events of one request, in the order a pull-mode request meets them (and
# the order views list them). A record may miss some (a failed request stops
# somewhere). With layer-wise push, D's events up to transfer_end overlap P's,
# so order is checked per chain (CAUSAL_CHAINS), not along this tuple.
EVENT_ORDER: tuple[str, ...] = (
    "arrival",  # the router has the request (parsed, tokenized)
    "dispatch",  # the router hands it to P
    "p_queued",  # P's scheduler queued it (vLLM RequestStateStats.queued_ts)
    "p_scheduled",  # P's scheduler first ran it (scheduled_ts)
    "p_tier_loaded",  # P's worker had loaded its host-tier hit (p_scheduled + the load's time; only with one)
    "p_done",  # P's prefill produced its token (first_token_ts): prefill done
    "d_queued",  # D's scheduler queued it
    "d_tier_load_start",  # D's worker began loading its host-tier hit (only with one; then it starts the pull)
    "d_tier_loaded",  # ... and had loaded it
    "transfer_start",  # D's worker asked P for the KV (push: while P computes it)
    "transfer_end",  # ... and finished
    "d_kv_ready",  # D's scheduler saw the KV arrive
    "d_scheduled",  # D's scheduler ran it (after the KV arrived)
    "d_first_token",  # D's engine produced the first output token
    "first_token",  # the router received it
    "last_token",  # the router received the last output token
    "finish",  # the router finished the request (answered or failed)
)

# Events only some requests have: P's and D's tier loads, with a tier hit whose time was reported.
OPTIONAL_EVENTS: frozenset[str] = frozenset({"p_tier_loaded", "d_tier_load_start", "d_tier_loaded"})

# What must happen before what, in either transfer mode: P's path and D's path,
# joined at dispatch and at the finish. (With a push, D's first token may come
# before P's p_done: D needs every layer's KV, not P's last MLP or its sampling.)
CAUSAL_CHAINS: tuple[tuple[str, ...], ...] = (
    ("arrival", "dispatch", "p_queued", "p_scheduled", "p_tier_loaded", "p_done", "finish"),
    ("arrival", "dispatch", "d_queued", "d_tier_load_start", "d_tier_loaded", "transfer_start", "transfer_end",
     "d_kv_ready", "d_scheduled", "d_first_token", "first_token", "last_token", "finish"),
)


@dataclass(frozen=True)
class ClockOffset:
    """instance clock - router clock, measured as NTP does over one round trip."""

    offset_ns: int
    uncertainty_ns: int  # half the round trip: the offset is right within this

    def to_router(self, instance_ns: int) -> int:
        return instance_ns - self.offset_ns

    @staticmethod
    def measure(router_before_ns: int, instance_ns: int, router_after_ns: int) -> ClockOffset:
        mid = (router_before_ns + router_after_ns) // 2
        return ClockOffset(instance_ns - mid, (router_after_ns - router_before_ns + 1) // 2)


@dataclass
class GroupTransfer:
    group: int
    blocks: int
    bytes: int
    name: str = ""  # the KV-cache group's, as D's engine reports it ("": not reported)

    @property
    def label(self) -> str:
        """"group 1 (c4_kv)", or "group 1" unnamed: indices tell apart groups of one kind."""
        return f"group {self.group} ({self.name})" if self.name else f"group {self.group}"


@dataclass
class Migration:
    """The request moved off an instance lost under it (router/migration.py)."""

    at_ns: int  # router clock: when the router learned of the loss
    role: str  # "decode" | "prefill"
    lost: str  # the instance that died or was cut off
    tokens_sent: int  # output tokens the client had received by then
    reason: str
    to: str | None = None  # the instance that took the request on (None: none was left)


# Fields a record's file leaves out when unset (0 or None): most runs have no tier and no pool.
_LEFT_OUT_UNSET = ("p_tier_tokens", "d_tier_tokens", "predicted_p_tier_tokens", "predicted_d_tier_tokens",
                   "pool_instance", "predicted_pool_tokens", "pool_tokens", "pool_error")


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_instance: str | None = None
    decode_instance: str | None = None
    policy: str | None = None  # the routing policy that picked the instances
    # What the router's prefix index expected each side's cache to hold (None: no index);
    # p_cached_tokens / d_cached_tokens are what the engines then reported.
    predicted_p_hit_tokens: int | None = None
    predicted_d_hit_tokens: int | None = None
    p_cached_tokens: int = 0
    d_cached_tokens: int = 0
    transferred_tokens: int = 0
    transfer_groups: list[GroupTransfer] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)  # EVENT_ORDER name -> router-clock ns
    token_ns: list[int] = field(default_factory=list)  # router-clock arrival of each output token (ITL); on disk to the us
    finish_reason: str | None = None
    error: str | None = None  # the request failed: what the client was told
    transfer_error: str | None = None  # the KV pull failed but D recomputed: the request still succeeded
    # Of P's predicted hit, the tokens only pending there (routed, not yet confirmed by events).
    predicted_p_pending_tokens: int | None = None
    # P's first step of it to its last, as the router predicted it (router/prefill_cost.py taken_s).
    predicted_p_prefill_s: float | None = None
    # D prefilled it itself (router/local_prefill.py): no P events, no transfer; and the
    # decision's reason either way (None: local prefill off).
    local_prefill: bool = False
    prefill_reason: str | None = None
    # The client's W3C traceparent header, if it sent one (router/otlp.py continues its trace);
    # left out of the file when absent.
    traceparent: str | None = None
    # Each move off a lost instance, in order. Before the first token the record's events are
    # the last attempt's (the lost ones dropped); after it they stay the first token's.
    migrations: list[Migration] = field(default_factory=list)
    # Of p_cached_tokens / d_cached_tokens, those P / D loaded from its host KV tier (0: none, or no
    # tier; left out of the file).
    p_tier_tokens: int = 0
    d_tier_tokens: int = 0
    # Of predicted_p_hit_tokens / predicted_d_hit_tokens, those the router expected from each side's
    # host tier (0: none, or no tier; left out of the file).
    predicted_p_tier_tokens: int = 0
    predicted_d_tier_tokens: int = 0
    # D prefilled it reading a P's host tier first (the pool, docs/kv_tiers.md): that P, the tokens
    # the router expected it to offer, those D read (of transferred_tokens), and why a read planned
    # did not happen (D computed the prefix instead). Left out of the file when unset.
    pool_instance: str | None = None
    predicted_pool_tokens: int = 0
    pool_tokens: int = 0
    pool_error: str | None = None

    def mark(self, event: str, ns: int | None = None) -> None:
        assert event in EVENT_ORDER, f"unknown timeline event {event!r}"
        self.events[event] = time.monotonic_ns() if ns is None else ns

    def to_json(self) -> str:
        # Not asdict(): its deep copy of every field cost ~35 us a record; this builds the
        # same dict in ~6.
        d = dict(self.__dict__)
        d["transfer_groups"] = [dict(g.__dict__) for g in self.transfer_groups]
        d["migrations"] = [dict(m.__dict__) for m in self.migrations]
        d["token_us"] = compact_token_times(d.pop("token_ns"))
        if d["traceparent"] is None:
            del d["traceparent"]
        for optional in _LEFT_OUT_UNSET:
            if not d[optional]:
                del d[optional]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        d = dict(d)
        if "token_us" in d:  # runs before 2026-12-05 have token_ns
            d["token_ns"] = expand_token_times(d.pop("token_us"))
        d["transfer_groups"] = [GroupTransfer(**g) for g in d.get("transfer_groups", [])]
        d["migrations"] = [Migration(**m) for m in d.get("migrations", [])]
        return cls(**d)

    def out_of_order(self) -> list[tuple[str, str]]:
        """Present events adjacent on a causal chain that go backwards in time (a clock or a recording bug)."""
        bad: list[tuple[str, str]] = []
        for chain in CAUSAL_CHAINS:
            present = [(e, self.events[e]) for e in chain if e in self.events]
            bad += [(a, b) for (a, ta), (b, tb) in zip(present, present[1:]) if tb < ta and (a, b) not in bad]
        return bad


def compact_token_times(token_ns: list[int]) -> list[int]:
    """Token times as written: the first in microseconds, then each one's distance in
    microseconds from the one before (a 1,000-token answer's ~20 bytes a token -> ~6).
    Rounded to the microsecond once, not per step, so no error accumulates."""
    us = [(t + 500) // 1000 for t in token_ns]
    return us[:1] + [b - a for a, b in zip(us, us[1:])]


def expand_token_times(token_us: list[int]) -> list[int]:
    """compact_token_times, undone: router-clock ns, exact to the microsecond."""
    return [t * 1000 for t in itertools.accumulate(token_us)]
