"""An engine's KV-cache groups as a prefix hit needs them, and the one rule a window group adds.

vLLM's hybrid KV cache manager gives each kind of layer its own KV-cache group (Gemma3 and
gpt-oss: sliding-window and full-attention groups; transfer/groups.py describes them from vLLM's
specs). A prefix hit of E tokens needs every full-attention (or compressed) group's blocks of
tokens [0, E), and each sliding-window group's blocks of only its last window before E: those
holding tokens [E - window + 1, E) (vLLM's SlidingWindowManager.get_num_skipped_tokens). vLLM's
scheduler finds its own hits so; the host tier (transfer/tier_scheduler.py) and the router's
prefix index (router/prefix_index.py) and the pool's reads (transfer/host_tier.py) count theirs so
too, with `cut_to_windows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KvGroup:
    """One KV-cache group of an instance's engine (InstanceInfo.kv_groups)."""

    kind: str  # "full_attention" | "compressed" | "sliding_window" (transfer/plan.py GroupKind)
    block_size: int  # tokens per block
    window: int = 0  # a sliding-window group's window, in tokens

    @property
    def is_window(self) -> bool:
        return self.kind == "sliding_window"


def hash_block_size(block_sizes: Iterable[int]) -> int:
    """Tokens per entry of vLLM's Request.block_hashes for an engine whose groups have these block
    sizes: their greatest common divisor (one group: its own)."""
    return math.gcd(*block_sizes)


def hit_unit(block_sizes: Iterable[int]) -> int:
    """The tokens a prefix hit is a whole number of (vLLM's scheduler block size): the groups'
    least common multiple."""
    return math.lcm(*block_sizes)


def block_hash_index(block: int, block_size: int, hash_size: int) -> int:
    """Which of Request.block_hashes (of `hash_size` tokens each) names a group's block `block` (of
    `block_size` tokens): the hash of the prefix the block ends (BlockPool's _get_partial_block_hash)."""
    return (block + 1) * block_size // hash_size - 1


def window_first_block(computed_tokens: int, block_size: int, window: int) -> int:
    """The first block a window group holds once `computed_tokens` are computed: the one with token
    computed_tokens - window + 1 (blocks before it vLLM has freed)."""
    return max(0, (computed_tokens - window + 1) // block_size)


def window_blocks(start: int, end: int, block_size: int, window: int, computed_to: int = 0) -> range:
    """Of a window group's blocks (of `block_size` tokens) holding tokens [start, end), those it
    needs once `computed_to` tokens (at least `end`) are computed: the ones holding its last
    `window` tokens, as vLLM allocates them. `start` and `end` are multiples of `block_size`."""
    return range(max(start // block_size, window_first_block(max(computed_to, end), block_size, window)),
                 end // block_size)


def cut_to_windows(n: int, start: int, unit: int, windows: Iterable[tuple[int, int, int]],
                   held: Callable[[int, int], bool], computed_to: int = 0) -> int:
    """The hit rule: of a run of `n` units of `unit` tokens from token `start` that every full group
    holds, the longest run whose every window group (group, window, block size) holds its window's
    blocks (`held(group, block)`) before the run's end, or before `computed_to` when that is later
    (D pulling the rest of the prompt from P). Window blocks before `start` are the caller's.
    `unit` is a multiple of every group's block size (vLLM's scheduler block size)."""
    windows = tuple(windows)
    while n and windows and not all(held(g, i) for g, window, block_size in windows
                                    for i in window_blocks(start, start + n * unit, block_size, window, computed_to)):
        n -= 1
    return n
