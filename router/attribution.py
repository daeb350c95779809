"""Where a request's time went: phases as intervals, and TTFT split along its critical path.

Phases are intervals between recorded events and may overlap (a layer-wise
transfer runs under the prefill). The time to first token is split on the
critical path, at boundaries that every request crosses in order:

    arrival --queue-- p_scheduled --[tier_load]-- --prefill-- p_done --[d_tier_load | transfer | d_wait]-- d_scheduled --first_decode-- first_token

- queue: router (parse, dispatch) and P's scheduler queue;
- tier_load: P's worker loading the prompt's host-tier hit back to the device, before the first
  step's forward pass (only with such a hit whose time P reported: docs/kv_tiers.md);
- prefill: P computing the prompt past its prefix hit;
- d_tier_load: D's worker loading the part of the prompt its own host tier holds, before it starts
  the pull, clipped to [p_done, d_scheduled] (only with such a hit; with a push it mostly runs
  under P's prefill, off the path);
- transfer: the part of the KV pull NOT hidden under the prefill, i.e. the pull
  interval clipped to [p_done, d_scheduled];
- (off the path: `transfer_hidden_ns`, the pull interval clipped to the
  prefill [p_scheduled, p_done]: what a layer-wise push hid under it;)
- d_wait: the rest of [p_done, d_scheduled]: the handoff through the router,
  D's queue, D's scheduler noticing the KV;
- first_decode: D's first step (the last prompt token) and the token's way back.

A request D prefilled itself (router/local_prefill.py; no P, no transfer) has one more:

    arrival --queue-- d_scheduled --local_prefill-- first_token

- queue: the router and D's scheduler queue;
- local_prefill: D computing what its cache lacked, in steps beside the requests it decodes,
  and the first token's way back; every other part is 0 (and a remote prefill has no
  local_prefill part: read it as 0).

A request moved off a lost instance before its first token (router/migration.py) starts its
path with the time lost to the failed attempts:

    arrival --migration-- the last such move --queue-- ...

(a move after the first token leaves TTFT alone: it shows in the record's migrations and as
a gap between its tokens).

By construction the parts sum to first_token - arrival exactly; against
a client's own TTFT they differ by the HTTP hop and the clock offsets' stated
uncertainty.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.router.timeline import EVENT_ORDER, RequestRecord

CRITICAL_PATH = ("migration", "queue", "tier_load", "prefill", "d_tier_load", "transfer", "d_wait", "first_decode",
                 "local_prefill")
OPTIONAL_PARTS = frozenset({"migration", "tier_load", "d_tier_load", "local_prefill"})  # most requests have none: read as 0


def critical_path(atts: Iterable[Attribution]) -> tuple[str, ...]:
    """The parts to show for these requests: an optional one only if one of them has it."""
    atts = list(atts)
    return tuple(n for n in CRITICAL_PATH if n not in OPTIONAL_PARTS or any(n in a.parts_ns for a in atts))


# Every interval worth drawing: (name, start event, end event, where it runs).
INTERVALS: tuple[tuple[str, str, str, str], ...] = (
    ("router", "arrival", "dispatch", "router"),
    ("to_p", "dispatch", "p_queued", "router"),  # the hop to P's scheduler: the channel, P's front end taking it in
    ("p_queue", "p_queued", "p_scheduled", "prefill"),
    ("tier_load", "p_scheduled", "p_tier_loaded", "prefill"),
    ("prefill", "p_scheduled", "p_done", "prefill"),
    ("handoff", "p_done", "d_queued", "router"),
    ("d_queue", "d_queued", "transfer_start", "decode"),
    ("d_tier_load", "d_tier_load_start", "d_tier_loaded", "decode"),
    ("transfer", "transfer_start", "transfer_end", "transfer"),
    ("d_kv_wait", "transfer_end", "d_scheduled", "decode"),
    ("first_decode", "d_scheduled", "d_first_token", "decode"),
    ("local_prefill", "d_scheduled", "d_first_token", "decode"),  # the same events, D having prefilled
    ("return", "d_first_token", "first_token", "router"),
    ("decode", "first_token", "last_token", "decode"),
)


# Intervals that only exist in pull mode: with a push, D has the request before P is done.
PUSH_REVERSED = frozenset({"handoff"})


@dataclass(frozen=True)
class Interval:
    name: str
    where: str  # "router" | "prefill" | "decode" | "transfer"
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class Attribution:
    parts_ns: dict[str, int]  # CRITICAL_PATH name -> ns, only the parts whose bounds were recorded
    ttft_ns: int | None  # first_token - arrival, if both were recorded
    stopped_after: str | None  # the last event reached, when the request did not reach first_token
    error: str | None
    # The KV transfer's part under P's prefill ([p_scheduled, p_done]): work a
    # layer-wise push took off the critical path. None: not recorded.
    transfer_hidden_ns: int | None = None

    @property
    def complete(self) -> bool:
        """Every part recorded (an optional part a request lacks counts as 0)."""
        return self.ttft_ns is not None and all(n in self.parts_ns for n in CRITICAL_PATH if n not in OPTIONAL_PARTS)


def intervals(rec: RequestRecord) -> list[Interval]:
    """Every phase interval whose two events were recorded (they may overlap; a negative
    one is a recording bug, except those a push reverses, which are left out)."""
    ev = rec.events
    skip = "first_decode" if rec.local_prefill else "local_prefill"
    return [Interval(name, where, ev[a], ev[b]) for name, a, b, where in INTERVALS
            if a in ev and b in ev and name != skip and not (name in PUSH_REVERSED and ev[b] < ev[a])]


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def _path_start(rec: RequestRecord, parts: dict[str, int]) -> int | None:
    """Where the queue part starts: arrival, or the last move before the first token (the
    time before it is the migration part)."""
    ev = rec.events
    if "arrival" not in ev:
        return None
    before = [m.at_ns for m in rec.migrations if "first_token" not in ev or m.at_ns < ev["first_token"]]
    if not before:
        return ev["arrival"]
    parts["migration"] = max(before) - ev["arrival"]
    return max(before)


def attribute(rec: RequestRecord) -> Attribution:
    if rec.local_prefill:
        return _attribute_local(rec)
    ev = rec.events
    parts: dict[str, int] = {}
    start = _path_start(rec, parts)
    if start is not None and "p_scheduled" in ev:
        parts["queue"] = ev["p_scheduled"] - start
    # P stamps p_done when its output leaves the engine; with a layer-wise push D
    # can hold all the KV, and even be scheduled, a moment before that.
    p_end = min(ev["p_done"], ev["d_scheduled"]) if "p_done" in ev and "d_scheduled" in ev else ev.get("p_done")
    if "p_scheduled" in ev and p_end is not None:
        computed_from = ev["p_scheduled"]
        if "p_tier_loaded" in ev:
            computed_from = min(ev["p_tier_loaded"], p_end)
            parts["tier_load"] = computed_from - ev["p_scheduled"]
        parts["prefill"] = p_end - computed_from
    if p_end is not None and "d_scheduled" in ev:
        gap = ev["d_scheduled"] - p_end
        exposed = 0
        if "transfer_start" in ev and "transfer_end" in ev:
            exposed = _overlap(ev["transfer_start"], ev["transfer_end"], p_end, ev["d_scheduled"])
        parts["transfer"] = exposed
        if "d_tier_load_start" in ev and "d_tier_loaded" in ev:  # (it ends before the pull starts)
            loaded = min(ev["d_tier_loaded"], ev.get("transfer_start", ev["d_tier_loaded"]))
            parts["d_tier_load"] = _overlap(ev["d_tier_load_start"], loaded, p_end, ev["d_scheduled"])
        parts["d_wait"] = gap - exposed - parts.get("d_tier_load", 0)
    if "d_scheduled" in ev and "first_token" in ev:
        parts["first_decode"] = ev["first_token"] - ev["d_scheduled"]
    hidden = None
    if all(e in ev for e in ("transfer_start", "transfer_end", "p_scheduled", "p_done")):
        hidden = _overlap(ev["transfer_start"], ev["transfer_end"], ev["p_scheduled"], ev["p_done"])
    return Attribution(parts, _ttft(ev), _stopped_after(ev), rec.error, hidden)


def _attribute_local(rec: RequestRecord) -> Attribution:
    ev = rec.events
    parts: dict[str, int] = {"prefill": 0, "transfer": 0, "d_wait": 0, "first_decode": 0}
    start = _path_start(rec, parts)
    if start is not None and "d_scheduled" in ev:
        parts["queue"] = ev["d_scheduled"] - start
    if "d_scheduled" in ev and "first_token" in ev:
        parts["local_prefill"] = ev["first_token"] - ev["d_scheduled"]
    return Attribution(parts, _ttft(ev), _stopped_after(ev), rec.error)


def _ttft(ev: dict[str, int]) -> int | None:
    return ev["first_token"] - ev["arrival"] if "arrival" in ev and "first_token" in ev else None


def _stopped_after(ev: dict[str, int]) -> str | None:
    """The last event reached, when the request did not reach first_token."""
    if "first_token" in ev:
        return None
    reached = [e for e in EVENT_ORDER if e in ev and e != "finish"]
    return reached[-1] if reached else None
