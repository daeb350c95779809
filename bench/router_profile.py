"""Where a router process's time goes: py-spy's raw stacks folded into a few named costs.

`py-spy record --format raw` writes one line per distinct stack, "frame;frame;... count",
outermost frame first, each frame "function (file:line)". `fold` assigns every sample to the
first category in `CATEGORIES` one of whose patterns occurs in any frame of its stack, so the
order goes from the most specific cost to the most general (the HTTP framework and the event
loop sit under everything). Stacks with no Python frame (a thread in native code) are
"native, no Python frame". Samples are of threads that were not idle: a share is of the
process's busy time, not of one core. One thread py-spy cannot see idle is left out: a Ray
worker's main thread waiting in C++ for tasks (`Worker.main_loop` innermost); it showed as 18%
of the router's samples while /proc gave that thread 1% of the CPU, the event loop's thread 95%.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

NATIVE = "native, no Python frame"
IDLE_INNERMOST = ("Worker.main_loop (",)  # a Ray worker's main thread, blocked in C++ between tasks
OTHER = "other"

# (category, substrings of a frame); first match wins.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tokenize the prompt", ("_PromptTokenizer", "PreTrainedTokenizerBase.encode", "apply_chat_template")),
    ("detokenize the output", ("_Detokenizer.add",)),
    ("timeline record + metrics", ("RunStore.append", "RequestRecord.to_json", "RouterMetrics.observe",
                                   "record_prefill", "record_decode_end", "_record_tokens", "RequestRecord.mark",
                                   "prometheus_client")),
    ("routing: hash, match, pick", ("InstancePicker", "chain_hashes", "pick_prefill", "pick_decode", "KvEventFeed")),
    ("request channel: encode, send, receive", ("request_channel.py", "channel_wire.py")),
    ("Ray: (de)serialize messages", ("ray/_private/serialization.py", "cloudpickle", "msgpack")),
    ("Ray: submit prefill/decode calls", ("ray/actor.py",)),
    ("Ray: await results and stream items", ("object_ref_generator.py", "PDDispatcher._next_delta",
                                             "PDDispatcher._prefill ")),
    ("parse + validate the request", ("_parse (", "make_job", "model_validate", "check_model")),
    ("build the response (JSON, SSE)", ("_envelope", "_usage", "JSONResponse", "_sse", "_event (")),
    ("engine actor method bodies", ("instant_engine.py",)),
    ("pdcluster request path, own code", ("pdcluster/router/", "(router/")),  # installed, or editable
    ("HTTP server + ASGI framework", ("uvicorn/", "starlette/", "fastapi/", "h11/", "httptools")),
    ("asyncio event loop, threads", ("asyncio/", "concurrent/futures", "threading.py")),
    ("Ray worker, other", ("ray/",)),
)


def categorize(frames: Sequence[str]) -> str:
    frames = [f for f in frames if f]
    if not frames:
        return NATIVE
    for name, patterns in CATEGORIES:
        if any(p in f for f in frames for p in patterns):
            return name
    return OTHER


def fold(raw_lines: Iterable[str]) -> dict[str, int]:
    """Samples per category from py-spy's raw output."""
    out: dict[str, int] = {}
    for line in raw_lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_INNERMOST):
            continue
        cat = categorize(frames)
        out[cat] = out.get(cat, 0) + int(count)
    return out


@dataclass(frozen=True)
class Profile:
    process: str
    samples: dict[str, int]
    rate_hz: int
    duration_s: float
    requests: int  # served while it was sampled
    cpu_s: float  # the process's CPU time meanwhile (psutil)

    @property
    def total(self) -> int:
        return sum(self.samples.values())

    def us_per_request(self, category: str) -> float:
        """The category's share of the busy samples, times the process's CPU per request."""
        if not self.total or not self.requests:
            return float("nan")
        return self.samples.get(category, 0) / self.total * self.cpu_s / self.requests * 1e6


def record(pid: int, out: Path, duration_s: int, rate_hz: int, py_spy: str = "py-spy") -> subprocess.Popen:
    """Start py-spy on `pid` (non-blocking: it does not pause the process to sample)."""
    return subprocess.Popen([py_spy, "record", "-p", str(pid), "-d", str(duration_s), "-r", str(rate_hz),
                             "--format", "raw", "--nonblocking", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def format_profiles(profiles: Sequence[Profile]) -> str:
    cats = [c for c, _ in CATEGORIES] + [NATIVE, OTHER]
    used = [c for c in cats if any(p.samples.get(c) for p in profiles)]
    head = ["cost"] + [f"{p.process} share" for p in profiles] + [f"{p.process} us/req" for p in profiles]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in used:
        shares = [f"{p.samples.get(c, 0) / p.total:.1%}" if p.total else "-" for p in profiles]
        per_req = [f"{p.us_per_request(c):,.0f}" for p in profiles]
        rows.append("| " + " | ".join([c, *shares, *per_req]) + " |")
    totals = [f"{p.cpu_s / p.requests * 1e6:,.0f} CPU us/req" if p.requests else "-" for p in profiles]
    rows.append("| total | " + " | ".join([f"{p.total} samples" for p in profiles] + totals) + " |")
    return "\n".join(rows)
