"""What each of an engine's KV-cache groups is, as the transfer needs to know it.

vLLM's KVCacheConfig puts layers with the same kind of state into one group
(`kv_cache_groups`); every layer of a group shares its block table. The
transfer moves blocks per group, and what to move depends on the group's kind
(transfer/plan.py). This module is the one place that maps vLLM's spec classes
to those kinds, so a new kind of state is one new branch here and one rule there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from pdcluster.transfer.plan import GroupKind

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class GroupInfo:
    index: int
    kind: GroupKind
    spec_name: str  # vLLM's spec class, for messages and reports
    block_size: int  # tokens per block (groups may differ: DeepSeek-V4 has 256, 64, 8, 4)
    # Trailing blocks that hold the window: cdiv(window, block) + 1, since the
    # window rarely starts on a block boundary. 0: not a window group.
    window_blocks: int
    page_bytes: int  # one block of this group, summed over its layers


def describe_groups(kv_cache_config: KVCacheConfig) -> tuple[GroupInfo, ...]:
    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        page_bytes = spec.page_size_bytes * len(group.layer_names)
        if type(spec) is FullAttentionSpec:
            out.append(GroupInfo(i, "full_attention", type(spec).__name__, spec.block_size, 0, page_bytes))
        elif type(spec) is SlidingWindowSpec:
            window_blocks = -(-spec.sliding_window // spec.block_size) + 1
            out.append(GroupInfo(i, "sliding_window", type(spec).__name__, spec.block_size, window_blocks,
                                 page_bytes))
        else:
            raise NotImplementedError(f"KV-cache group {i} is {type(spec).__name__}: pdcluster has no transfer "
                                      f"rule for it (transfer/groups.py)")
    return tuple(out)
