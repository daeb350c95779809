"""Named loads. `c90` is the users' production run; `c90-tiny` is the same shape scaled to this machine.

c90 (../shared/seeds/002): DeepSeek-V4-Flash on Ascend 910C, P8+D8, AISBench:
131,076 input tokens of which 118,784 (928 blocks of 128) are cached, 1,024
output tokens, at most 90 in flight, 6 req/s, 640 requests, after 16 seed and 16
cache-check requests (16 prefix families).

c90-tiny keeps the structure (a ~90% block-aligned shared prefix per family, a
seed and a cache-check phase, a rate cap over a concurrency cap) and scales what
this machine cannot hold: a tiny model on P1D1 pinned to one core each, where a
4K-token prefill takes ~0.4 s (128K would take minutes), so 4,100-token prompts
with 3,712 cached (29 blocks, 90.5%), 32 output tokens, 8 in flight, 2 req/s,
40 requests over 4 families.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    input_len: int
    shared_prefix_tokens: int  # per family, block-aligned
    output_len: int
    num_prefixes: int
    num_requests: int
    max_concurrency: int
    request_rate: float | None
    burstiness: float = 1.0
    seed_phase: bool = True  # one seed and one cache-check request per family before the formal window
    warmup: int = 0

    @property
    def shared_prefix_ratio(self) -> float:
        return self.shared_prefix_tokens / self.input_len


PRESETS: dict[str, Preset] = {
    "c90": Preset("c90", input_len=131076, shared_prefix_tokens=118784, output_len=1024, num_prefixes=16,
                  num_requests=640, max_concurrency=90, request_rate=6.0),
    "c90-tiny": Preset("c90-tiny", input_len=4100, shared_prefix_tokens=3712, output_len=32, num_prefixes=4,
                       num_requests=40, max_concurrency=8, request_rate=2.0),
}
