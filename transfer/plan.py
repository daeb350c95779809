"""Which of P's blocks go into which of D's blocks, per KV-cache group.

Pure functions of block counts and lists: no engine, no tensors, so the rules
are unit-tested on their own. P's blocks are named by their index in P's block
table (block i of a group holds its tokens [i*bs, (i+1)*bs)), not by P's block
ids: D plans before P has allocated them (layer-wise push), and P maps indices
to ids when it serves them. The plan is per group because each kind of state
moves differently (vLLM's KVCacheConfig.kv_cache_groups):

- full attention: every block past what D's prefix cache already holds;
- compressed (DeepSeek-V4's C4/C128 compressed KV and indexer keys: one entry
  per 4 or 128 tokens, in 256-token blocks): the same rule, every block past
  D's hit, under its own name so reports say what moved;
- sliding window: only the blocks covering the last `window` tokens (vLLM
  allocates D no others: out-of-window positions get its null block); also
  DeepSeek-V4's per-layer window KV and compressor state, each group with its
  own window and block size;
- recurrent state: not yet (transfer/groups.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

GroupKind = Literal["full_attention", "compressed", "sliding_window"]

# vLLM's BlockPool hands out block 0 as the null block (out-of-window positions of sliding-window
# groups point at it); it never holds a request's KV.
NULL_BLOCK_ID = 0


class PlanError(ValueError):
    """P's and D's block lists cannot be paired: a bug or an incompatible peer."""


@dataclass(frozen=True)
class GroupPlan:
    group: int
    kind: GroupKind
    remote_indices: tuple[int, ...]  # positions in P's block table to read, ascending
    local_block_ids: tuple[int, ...]  # D's blocks to write, same order

    def __post_init__(self):
        assert len(self.remote_indices) == len(self.local_block_ids), (
            f"group {self.group}: {len(self.remote_indices)} remote vs {len(self.local_block_ids)} local blocks")
        assert list(self.remote_indices) == sorted(set(self.remote_indices)), (
            f"group {self.group}: remote indices {self.remote_indices} not ascending and distinct")

    @property
    def num_blocks(self) -> int:
        return len(self.remote_indices)


@dataclass(frozen=True)
class TransferPlan:
    groups: tuple[GroupPlan, ...]
    d_cached_tokens: int  # what D's own prefix cache held
    transferred_tokens: int  # prompt tokens whose KV comes from P

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def plan_full_attention(group: int, num_remote: int, local_new: tuple[int, ...],
                        num_local_hit_blocks: int, kind: GroupKind = "full_attention") -> GroupPlan:
    """Pair P's blocks past D's hit with D's freshly allocated blocks.

    P's table has `num_remote` blocks for the prompt, block i holding tokens
    [i*bs, (i+1)*bs). D's first `num_local_hit_blocks` blocks came from its own
    prefix cache; `local_new` are the blocks D allocated for the rest, in order.
    """
    wanted = range(num_local_hit_blocks, num_remote)
    if len(wanted) != len(local_new):
        raise PlanError(f"group {group}: P has {num_remote} blocks, D holds {num_local_hit_blocks} and "
                        f"allocated {len(local_new)} for the rest; expected {len(wanted)}")
    return GroupPlan(group, kind, tuple(wanted), tuple(local_new))


def plan_window_tail(group: int, num_remote: int, local_new: tuple[int, ...], window_blocks: int) -> GroupPlan:
    """Pair D's window blocks with P's last blocks: both lists end at the prompt's last block.

    P keeps only its last `window_blocks` blocks (it frees older ones as the
    window slides); `local_new` are the blocks D allocated for the window past its
    own hit."""
    if len(local_new) > min(window_blocks, num_remote):
        raise PlanError(f"group {group}: D wants {len(local_new)} window blocks, P holds only "
                        f"{min(window_blocks, num_remote)}")
    return GroupPlan(group, "sliding_window", tuple(range(num_remote - len(local_new), num_remote)), tuple(local_new))


class GroupShape(Protocol):
    """What the planner needs of one KV-cache group (transfer/groups.py's GroupInfo)."""

    kind: GroupKind
    block_size: int  # tokens per block
    window_blocks: int  # window groups: blocks that hold the window; else 0


def plan_transfer(shapes: tuple[GroupShape, ...], local_new: tuple[tuple[int, ...], ...],
                  num_local_hit_blocks: tuple[int, ...], d_cached_tokens: int, num_tokens: int) -> TransferPlan:
    """D's plan for a prompt of `num_tokens` whose KV P computes from token 0."""
    if not len(shapes) == len(local_new) == len(num_local_hit_blocks):
        raise PlanError(f"group counts differ: groups {len(shapes)}, D blocks {len(local_new)}, "
                        f"D hits {len(num_local_hit_blocks)}: P and D run different models or KV layouts")
    groups = []
    for g, (shape, new, hit) in enumerate(zip(shapes, local_new, num_local_hit_blocks)):
        num_remote = blocks_for(num_tokens, shape.block_size)
        if shape.kind in ("full_attention", "compressed"):
            groups.append(plan_full_attention(g, num_remote, new, hit, shape.kind))
        elif shape.kind == "sliding_window":
            groups.append(plan_window_tail(g, num_remote, new, shape.window_blocks))
        else:
            raise PlanError(f"group {g}: no transfer rule for {shape.kind!r} yet")
    return TransferPlan(tuple(groups), d_cached_tokens, num_tokens - d_cached_tokens)
