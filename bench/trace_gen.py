"""Mooncake-format traces of prefix families arriving as real traffic does (issue 15).

Each request belongs to one of `families` (chosen uniformly at random): the family's
shared history (`shared_tokens`, the same hash ids for every request of it) and then
blocks of its own, `input_len` tokens in all. Arrivals are Poisson at `rate` requests/s
from t=0, with no seed phase: a family's first requests find no cache anywhere. The
structural maximum hit (an unlimited cache and perfect routing) is what
`workloads.trace_hit_ratio_from_ids` says of the trace.

    .venv/bin/python -m pdcluster.bench.trace_gen --families 8 --requests 96 --rate 6 \\
        --input-len 131072 --shared-tokens 118784 --output-len 1024 --out /tmp/fam8.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.replay.workloads import TRACE_BLOCK, TraceRow, trace_hit_ratio_from_ids


@dataclass(frozen=True)
class FamilyTrace:
    families: int
    requests: int
    rate: float  # requests/s, Poisson
    input_len: int
    shared_tokens: int  # each family's history, a multiple of the trace block
    output_len: int
    seed: int = 0

    def __post_init__(self):
        for name in ("families", "requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be at least 1")
        if self.rate <= 0:
            raise ValueError(f"rate {self.rate}: must be positive")
        if self.shared_tokens % TRACE_BLOCK or not 0 <= self.shared_tokens < self.input_len:
            raise ValueError(f"shared_tokens {self.shared_tokens}: a multiple of {TRACE_BLOCK} below "
                             f"input_len {self.input_len}")

    def rows(self) -> list[TraceRow]:
        rng = random.Random(self.seed)
        shared_blocks = self.shared_tokens // TRACE_BLOCK
        total_blocks = -(-self.input_len // TRACE_BLOCK)
        next_id = self.families * shared_blocks  # ids below are the families' histories
        rows, t_ms = [], 0.0
        for _ in range(self.requests):
            f = rng.randrange(self.families)
            own = list(range(next_id, next_id + total_blocks - shared_blocks))
            next_id += len(own)
            rows.append(TraceRow(round(t_ms, 3), self.input_len, self.output_len,
                                 tuple(range(f * shared_blocks, (f + 1) * shared_blocks)) + tuple(own)))
            t_ms += rng.expovariate(self.rate) * 1000
        return rows


def write(rows: list[TraceRow], path: Path) -> None:
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson)")
    ap.add_argument("--input-len", type=int, default=131072)
    ap.add_argument("--shared-tokens", type=int, default=118784)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    try:
        trace = FamilyTrace(a.families, a.requests, a.rate, a.input_len, a.shared_tokens, a.output_len, a.seed)
    except ValueError as err:
        raise SystemExit(f"trace_gen: {err}") from None
    rows = trace.rows()
    write(rows, a.out)
    print(f"{a.out}: {len(rows)} requests over {rows[-1].timestamp_ms / 1000:.1f} s; structural maximum hit "
          f"{trace_hit_ratio_from_ids(rows, 128):.2%} (128-token cache blocks)")


if __name__ == "__main__":
    main()
