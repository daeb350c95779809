"""Which of a run's requests the timeline tools look at (`--phase`, `--between`).

A replay (`pdc bench run`, the virtual clock) sends its load in phases and names each request
after its phase (proto/load_phases.py); its figures are the formal window's. So on a run that
holds replayed requests the tools default to the formal phase, as the replay did, and say so:
otherwise `pdc timeline summary` would mix the cold seed requests into TTFT's percentiles and
print a different p99 from the replay's for the same run. A run directory that served several
replays (one cluster, several `pdc bench run`) is read in the last one's window (`--replay`
names another, or all). `--phase all` takes every request; `--between A,B` those that arrived A
to B seconds after the run's first arrival.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from pdcluster.proto.load_phases import PHASES, phase_of, replay_of
from pdcluster.router.run_store import Run

CHOICES = ("auto", "all", *PHASES)


def parse_between(text: str) -> tuple[float, float]:
    """`A,B` (seconds after the first arrival, A < B): the `--between` flag's value."""
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--between {text!r}: two numbers A,B (seconds after the run's first arrival)") from None
    if not 0 <= a < b:
        raise ValueError(f"--between {text!r}: needs 0 <= A < B")
    return a, b


def select(run: Run, phase: str = "auto", between: tuple[float, float] | None = None,
           replay: str = "last") -> tuple[Run, str]:
    """The run with only the requests asked for, and a line naming the window. `replay`: of a
    run that holds several replays, which one's phase (`last`: the one that began last; `all`)."""
    assert phase in CHOICES, f"phase {phase!r}"
    phases = Counter(phase_of(r.request_id) for r in run.records)
    if phase == "auto":
        phase = "formal" if phases.get("formal") else "all"
    records = run.records if phase == "all" else [r for r in run.records if phase_of(r.request_id) == phase]
    window = "every request" if phase == "all" else f"the {phase} phase"
    if phase != "all":
        begun: dict[str, int] = {}  # replay -> its first arrival
        for r in records:
            source = replay_of(r.request_id)
            begun[source] = min(begun.get(source, r.events.get("arrival", 0)), r.events.get("arrival", 0))
        if replay == "last" and len(begun) > 1:
            replay = max(begun, key=begun.get)
        if replay not in ("last", "all"):
            if replay not in begun:
                raise ValueError(f"--replay {replay}: no such replay's {phase} phase in run {run.meta.run_id} "
                                 f"(there: {', '.join(sorted(begun)) or 'none'})")
            records = [r for r in records if replay_of(r.request_id) == replay]
            window += f" of replay {replay}" + (f" ({len(begun)} in this run: --replay all for all)"
                                                 if len(begun) > 1 else "")
        elif len(begun) > 1:
            window += f" of all {len(begun)} replays"
    if between is not None:
        first = min((r.events["arrival"] for r in run.records if "arrival" in r.events), default=0)
        lo, hi = (first + int(x * 1e9) for x in between)
        records = [r for r in records if lo <= r.events.get("arrival", -1) < hi]
        window += f", arrived {between[0]:g}-{between[1]:g} s after the first"
    line = f"window: {window} ({len(records)} of {len(run.records)} requests"
    if phase != "all":
        others = ", ".join(f"{p} {phases[p]}" for p in PHASES if phases.get(p) and p != phase)
        line += (f"; also {others}" if others else "") + "; --phase all for every request"
    return dataclasses.replace(run, records=records), line + ")"
