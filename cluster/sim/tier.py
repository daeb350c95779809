"""The simulated engine's host KV tier (issue 29): the real tier's book over the pool's block hashes.

What a vLLM instance's tier does in our connector (transfer/tier_scheduler.py), restated for the
simulated scheduler (scheduler_core.py), with the same book (transfer/tier_book.py) and so the same
keeping, eviction and retention rules:
- write-through: a request that ends hands its computed prompt blocks to the tier, which keeps
  what room allows (least recently used evicted first, a prompt's tail before its head);
- a request the device cache misses loads the tier's run past the device hit instead of computing
  it: a synchronous load, its bytes over the host link (the parameter file's `host_link`: PCIe,
  HCCS) added to the step that first schedules the request (P: the step that admits it; D: the
  step after its transfer, as our connector loads the tier's part of a pull in the worker);
- what the tier holds is announced as KV cache events with medium "CPU", as our connector
  announces it, so the router's index prices it apart from the device's (router/prefix_index.py).

One block of the tier is one block of the pool: every full and compressed component
(`CostModel.block_bytes`); window and state components are a request's last blocks only and ride
with the hit as they do on the device (cluster/sim/block_pool.py). The loads of one step share
the instance's host link (scheduler_steps.py sums their tokens into one load). Not modelled: the
copies out to the tier (they overlap compute on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.cluster.sim.cost import CostModel
from pdcluster.cluster.sim.kv_wire import BlockHash, BlockRemoved, BlockStored, KvCacheEvent, external_hashes
from pdcluster.proto.handle import MAX_RETENTION_S
from pdcluster.proto.kv_event_wire import HOST_MEDIUM
from pdcluster.proto.messages import TierCounts
from pdcluster.transfer.paged_kv import block_runs
from pdcluster.transfer.tier_book import TierBook

_GROUP = 0  # the simulated pool is one group: a block stands for every component


class SimTier:
    def __init__(self, capacity_bytes: int, cost: CostModel, int_hashes: bool,
                 max_retention_s: float = MAX_RETENTION_S):
        """`int_hashes`: events carry hashes as the pool's do (block_pool.py)."""
        cost.host_load_s(0)  # SimParamsError now, not at the first load, if the file prices no host link
        self.book = TierBook(capacity_bytes, max_retention_s)
        self.cost = cost
        self.block_bytes, self.block_size = cost.block_bytes, cost.block_size
        self._int_hashes = int_hashes
        self._events: list[KvCacheEvent] = []
        self.loaded_blocks = 0  # blocks loaded back to the device, all told
        self.evicted_blocks = 0
        self.load_seconds = 0.0  # the loads' modelled time, all told
        self.stored_blocks = 0
        self.served_blocks = 0  # offered to the pool's readers

    def lookup(self, block_hashes: Sequence[BlockHash], first: int, max_hit_tokens: int) -> int:
        """Blocks past the device's hit (its first `first` blocks) the tier holds in a run, within
        `max_hit_tokens` (the last prompt token is always computed); counted as used now."""
        last = max(first, max_hit_tokens // self.block_size)
        return self.book.match({_GROUP: block_hashes[first:last]})

    def offer(self, block_hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """The pool (an OpenPool): the prompt tokens the run of its first blocks the tier holds covers
        (its last token left to compute), counted as used now. Not pinned: a read is instant on the book."""
        blocks = self.lookup(block_hashes, 0, prompt_tokens - 1)
        self.served_blocks += blocks
        return blocks * self.block_size

    def load_s(self, tokens: int) -> float:
        """The host link's time for loading `tokens` (whole blocks) back to the device."""
        return self.cost.host_load_s(tokens // self.block_size * self.block_bytes) if tokens > 0 else 0.0

    def loaded(self, blocks: int) -> None:
        self.loaded_blocks += blocks
        self.load_seconds += self.load_s(blocks * self.block_size)

    def counts(self) -> TierCounts:
        """What the real tier counts of itself (transfer/host_tier.py), in the model's bytes."""
        bb = self.block_bytes
        return TierCounts(self.book.used_bytes, self.loaded_blocks, self.loaded_blocks * bb, self.load_seconds,
                          self.stored_blocks, self.stored_blocks * bb, self.served_blocks)

    def finished(self, block_hashes: Sequence[BlockHash], tokens: Sequence[int], num_blocks: int, now_s: float,
                 retain_s: float = 0.0) -> None:
        """A request ended with its first `num_blocks` prompt blocks computed (`block_hashes`,
        over `tokens`): keep them, as room allows."""
        hashes = block_hashes[:num_blocks]
        kept = self.book.keep([((_GROUP, h), self.block_bytes) for h in hashes], now_s, retain_s)
        if kept.evicted:
            self.evicted_blocks += len(kept.evicted)
            self._events.append(BlockRemoved(block_hashes=external_hashes([h for _, h in kept.evicted],
                                                                          self._int_hashes),
                                             medium=HOST_MEDIUM, group_idx=_GROUP))
        stored, bs = {h for _, h in kept.stored}, self.block_size
        self.stored_blocks += len(stored)
        for first, n in block_runs([i for i, h in enumerate(hashes) if h in stored]):  # one event a run
            parent = external_hashes([hashes[first - 1]], self._int_hashes)[0] if first else None
            self._events.append(BlockStored(
                block_hashes=external_hashes(hashes[first:first + n], self._int_hashes), parent_block_hash=parent,
                token_ids=list(tokens[first * bs:(first + n) * bs]), block_size=bs, lora_id=None,
                medium=HOST_MEDIUM, lora_name=None, group_idx=_GROUP))

    def clear(self) -> None:
        """A cache reset: the tier empties too (vLLM's reset with its connector's)."""
        dropped = self.book.clear()
        if dropped:
            self._events.append(BlockRemoved(block_hashes=external_hashes([h for _, h in dropped], self._int_hashes),
                                             medium=HOST_MEDIUM, group_idx=_GROUP))

    def take_events(self) -> list[KvCacheEvent]:
        out, self._events = self._events, []
        return out


def tier_load_ns(tier: SimTier | None, req) -> int:
    """The modelled time of a P request's tier load (what P's worker reports of a real one): it opens
    the request's first step. 0 without one."""
    return round(tier.load_s(req.num_tier_tokens) * 1e9) if tier is not None and req.num_tier_tokens > 0 else 0


def host_tier(host_tier_gib: float | None, cost: CostModel, int_hashes: bool) -> SimTier | None:
    """The tier an instance's `engine.host_tier_gib` asks for (None: unset or 0, no tier)."""
    return SimTier(int(host_tier_gib * 2**30), cost, int_hashes) if host_tier_gib else None
