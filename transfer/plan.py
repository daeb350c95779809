"""Which of P's blocks go into which of D's blocks, per KV-cache group.

Pure functions of block lists and token counts: no engine, no tensors, so the
rules are unit-tested on their own. The plan is per group because each kind of
state moves differently (vLLM's KVCacheConfig.kv_cache_groups):

- full attention: every block past what D's prefix cache already holds;
- sliding window: only the blocks covering the last `window` tokens (vLLM
  allocates D no others: out-of-window positions get its null block);
- (next) compressed buffers and recurrent state: their own, fewer, blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GroupKind = Literal["full_attention", "sliding_window"]


class PlanError(ValueError):
    """P's and D's block lists cannot be paired: a bug or an incompatible peer."""


@dataclass(frozen=True)
class GroupPlan:
    group: int
    kind: GroupKind
    remote_block_ids: tuple[int, ...]  # P's blocks to read, in token order
    local_block_ids: tuple[int, ...]  # D's blocks to write, same order

    def __post_init__(self):
        assert len(self.remote_block_ids) == len(self.local_block_ids), (
            f"group {self.group}: {len(self.remote_block_ids)} remote vs {len(self.local_block_ids)} local blocks")

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)


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


def plan_full_attention(group: int, remote: tuple[int, ...], local_new: tuple[int, ...],
                        num_local_hit_blocks: int) -> GroupPlan:
    """Pair P's blocks past D's hit with D's freshly allocated blocks.

    `remote` covers the whole prompt prefix P computed, block i holding tokens
    [i*bs, (i+1)*bs). D's first `num_local_hit_blocks` blocks came from its own
    prefix cache; `local_new` are the blocks D allocated for the rest, in order.
    """
    wanted = remote[num_local_hit_blocks:]
    if len(wanted) != len(local_new):
        raise PlanError(f"group {group}: P has {len(remote)} blocks, D holds {num_local_hit_blocks} and "
                        f"allocated {len(local_new)} for the rest; expected {len(wanted)}")
    return GroupPlan(group, "full_attention", tuple(wanted), tuple(local_new))


def plan_window_tail(group: int, remote_tail: tuple[int, ...], local_new: tuple[int, ...]) -> GroupPlan:
    """Pair D's window blocks with P's last blocks: both lists end at the prompt's last block.

    `remote_tail` holds P's in-window blocks (P freed the older ones); `local_new`
    the blocks D allocated for the window past its own hit."""
    if len(local_new) > len(remote_tail):
        raise PlanError(f"group {group}: D wants {len(local_new)} window blocks, P holds only {len(remote_tail)}")
    return GroupPlan(group, "sliding_window", remote_tail[len(remote_tail) - len(local_new):], tuple(local_new))


def plan_transfer(kinds: tuple[GroupKind, ...], remote: tuple[tuple[int, ...], ...],
                  local_new: tuple[tuple[int, ...], ...], num_local_hit_blocks: tuple[int, ...],
                  d_cached_tokens: int, num_tokens: int) -> TransferPlan:
    if not len(kinds) == len(remote) == len(local_new) == len(num_local_hit_blocks):
        raise PlanError(f"group counts differ: kinds {len(kinds)}, P {len(remote)}, D {len(local_new)}, "
                        f"D hits {len(num_local_hit_blocks)}: P and D run different models or KV layouts")
    groups = []
    for g, kind in enumerate(kinds):
        if kind == "full_attention":
            groups.append(plan_full_attention(g, remote[g], local_new[g], num_local_hit_blocks[g]))
        elif kind == "sliding_window":
            groups.append(plan_window_tail(g, remote[g], local_new[g]))
        else:
            raise PlanError(f"group {g}: no transfer rule for {kind!r} yet")
    return TransferPlan(tuple(groups), d_cached_tokens, num_tokens - d_cached_tokens)
