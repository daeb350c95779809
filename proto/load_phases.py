"""A replayed load's phases, and how each of its requests is named after its phase.

`pdc bench run` and the virtual clock send a load in phases (cluster/replay/: warm-up, one seed
and one cache-check request per prefix family, then the formal window the figures are about) and
name each request `<source>-<phase>-<index>` (the bench: `bench-<run token>`, one per driver
process; the virtual clock: `sim`); the router's records carry it as `cmpl-<that>`. The timeline
tools read the phase back from the id (`phase_of`), so they look at the same window the replay
measured.
"""

from __future__ import annotations

import re

PHASES = ("warmup", "seed", "check", "formal")
_ID = re.compile(r"^cmpl-(?P<source>.+)-(?P<phase>" + "|".join(PHASES) + r")-(?P<index>\d+)$")


def replay_request_id(source: str, phase: str, index: int) -> str:
    """The id a replay sends (the router answers it as `cmpl-` + this)."""
    assert phase in PHASES, f"phase {phase!r}: one of {', '.join(PHASES)}"
    return f"{source}-{phase}-{index}"


def phase_of(request_id: str) -> str | None:
    """The phase of a replayed request's record id; None for any other request."""
    m = _ID.match(request_id)
    return m["phase"] if m else None


def replay_of(request_id: str) -> str | None:
    """Which replay sent it (`bench-<run token>`, `sim`); None for any other request."""
    m = _ID.match(request_id)
    return m["source"] if m else None
