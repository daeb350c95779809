"""What the load replayer sends and what it observes, one dataclass each.

Workloads (cluster/replay/workloads.py) produce `BenchRequest`s; the driver
(cluster/replay/driver.py) turns each into a `RequestResult`; metrics (cluster/replay/metrics.py)
reduce results to AISBench-style statistics. Times are client-side
`time.monotonic()` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["warmup", "seed", "check", "formal"]


@dataclass(frozen=True)
class BenchRequest:
    index: int  # position in the workload (stable across runs with the same seed)
    prompt_token_ids: tuple[int, ...]
    output_len: int
    # The prefix-cache hit the workload's structure implies (block-aligned), once the
    # cache holds what earlier requests put there; None when the workload cannot know.
    expected_cached_tokens: int | None = None
    arrival_s: float | None = None  # trace replay: seconds from the start; None: as soon as a slot frees
    phase: Phase = "formal"
    family: str | None = None  # the shared prefix it belongs to, if any


@dataclass
class RequestResult:
    index: int
    phase: Phase
    prompt_tokens: int
    start_s: float  # request sent
    end_s: float  # last byte received, or the failure
    request_id: str | None = None  # the server's response id (the router's timeline key)
    output_tokens: int = 0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    token_ids: list[int] = field(default_factory=list)  # the streamed ids, in order (servers that send them)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    expected_cached_tokens: int | None = None
    pd: dict[str, int | str | None] | None = None  # usage.pd from a pdcluster router
    error: str | None = None  # None: success
    # 429s (router admission control) this request got; `rejected`: it ended with one (not
    # retried, or out of retries), counted apart from failures.
    rejections: int = 0
    rejected: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None
