"""What each of an engine's KV-cache groups is, as the transfer needs to know it.

vLLM's KVCacheConfig puts layers with the same kind of state into one group
(`kv_cache_groups`); every layer of a group shares its block table. The
transfer moves blocks per group, and what to move depends on the group's kind
(transfer/plan.py). This module is the one place that maps vLLM's spec classes
to those kinds, so a new kind of state is one new branch here and one rule there.

vLLM 0.32 spec classes, and the kind each gets (subclasses first: SlidingWindowMLASpec
is a SlidingWindowSpec, MLAAttentionSpec a FullAttentionSpec):

| spec (per layer)                         | kind           | moves                                 |
|------------------------------------------|----------------|---------------------------------------|
| FullAttentionSpec                        | full_attention | every block past D's prefix hit       |
| MLAAttentionSpec, one entry per token    | full_attention | (MLA latent KV: the same)             |
| MLAAttentionSpec, tokens_per_state > 1   | compressed     | every block past D's hit (DeepSeek-V4: |
|                                          |                | C4/C128 compressed KV, indexer keys)  |
| SlidingWindowSpec, SlidingWindowMLASpec  | sliding_window | the window's tail blocks (DeepSeek-V4: |
|                                          |                | per-layer window KV, compressor state)|
| MambaSpec (recurrent state)              | NotImplementedError, see _recurrent_state  |
| anything else                            | NotImplementedError                        |

A group's spec may be vLLM's UniformTypeKVCacheSpecs wrapper (DeepSeek-V4's
groups are: per-layer specs of one type with different page sizes); its layers
are classified one by one and must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.proto.kv_groups import KvGroup
from pdcluster.transfer.plan import GroupKind
from pdcluster.transfer.vllm_compat import (  # vLLM's, through the module that knows each version
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    bounded_replay,
    tokens_per_state,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


@dataclass(frozen=True)
class GroupInfo:
    index: int
    kind: GroupKind
    spec_name: str  # vLLM's spec class (of the group's layers), for messages and reports
    block_size: int  # tokens per block (groups may differ: DeepSeek-V4 has 256, 64, 8, 4)
    # Trailing blocks that hold the window: cdiv(window, block) + 1, since the
    # window rarely starts on a block boundary. 0: not a window group.
    window_blocks: int
    page_bytes: int  # one block of this group, summed over its layers
    window: int = 0  # a window group's window, in tokens (0: not a window group)

    @property
    def shape(self) -> KvGroup:
        """As the router's prefix index needs it (InstanceInfo.kv_groups)."""
        return KvGroup(self.kind, self.block_size, self.window)

    @property
    def name(self) -> str:
        """For reports: its kind and vLLM's spec, e.g. "sliding_window (SlidingWindowSpec)"."""
        return f"{self.kind} ({self.spec_name})"


def layer_kind(spec: KVCacheSpec) -> tuple[GroupKind, int]:
    """The transfer kind of one layer's spec, and its window in tokens (0: none)."""
    # Exact types, subclasses before their bases: a subclass may keep its base's fields
    # and mean something else (a SlidingWindowMLASpec is a SlidingWindowSpec).
    if type(spec) is SlidingWindowMLASpec:
        if bounded_replay(spec):  # DeepSeek-V4.1: D would replay the window from below the hit
            raise NotImplementedError("SlidingWindowMLASpec with bounded_replay (DeepSeek-V4.1): pdcluster has "
                                      "no transfer rule for a replayed window")
        return "sliding_window", spec.sliding_window
    if type(spec) is SlidingWindowSpec:
        return "sliding_window", spec.sliding_window
    if type(spec) is MLAAttentionSpec:
        return ("compressed" if tokens_per_state(spec) > 1 else "full_attention"), 0
    if type(spec) is FullAttentionSpec:
        # Also a window layer when vLLM's hybrid manager is off (sliding_window set): it is
        # allocated as full attention, every block kept, so every block moves.
        return "full_attention", 0
    if isinstance(spec, MambaSpec):
        raise NotImplementedError(_recurrent_state(spec))
    raise NotImplementedError(f"{type(spec).__name__}: pdcluster has no transfer rule for it (transfer/groups.py)")


def _recurrent_state(spec: MambaSpec) -> str:
    # Not a simple rule, hence no rule: D's scheduler recomputes the prompt's last token
    # after a load that covers the whole prompt (vLLM 0.32 scheduler,
    # _update_waiting_for_remote_kv). For KV that rewrites the same entry; a recurrent
    # state P finished at token N-1 would take token N-1 a second time. A correct rule
    # needs P to stop its state one token short, or D to skip that recompute: both are
    # connector changes, not a block pairing.
    return (f"{type(spec).__name__} (recurrent state, mamba_cache_mode={spec.mamba_cache_mode!r}): pdcluster does "
            "not transfer it yet: D recomputes the prompt's last token on top of what it loads, which would apply "
            "that token to P's final state twice")


def describe_group(index: int, spec: KVCacheSpec, num_layers: int) -> GroupInfo:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        layer_specs = tuple(spec.kv_cache_specs.values())
        page_bytes = spec.page_size_bytes  # already the sum over its layers
    else:
        layer_specs = (spec,)
        page_bytes = spec.page_size_bytes * num_layers
    try:
        kinds = {layer_kind(s) for s in layer_specs}
    except NotImplementedError as err:
        raise NotImplementedError(f"KV-cache group {index}: {err}") from None
    names = sorted({type(s).__name__ for s in layer_specs})
    if len(kinds) != 1:
        raise NotImplementedError(f"KV-cache group {index} mixes layers that move differently ({sorted(kinds)}, "
                                  f"{', '.join(names)}): pdcluster cannot plan one block table for them")
    (kind, window), = kinds
    window_blocks = -(-window // spec.block_size) + 1 if window else 0
    return GroupInfo(index, kind, "+".join(names), spec.block_size, window_blocks, page_bytes, window)


def describe_groups(kv_cache_config: KVCacheConfig) -> tuple[GroupInfo, ...]:
    return tuple(describe_group(i, g.kv_cache_spec, len(g.layer_names))
                 for i, g in enumerate(kv_cache_config.kv_cache_groups))
