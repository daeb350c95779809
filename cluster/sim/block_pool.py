"""The simulated engine's KV block pool and prefix cache, with vLLM's rules.

A fixed number of blocks of `block_size` tokens. Block 0 is the null block, as in
vLLM (transfer/grpc_server.NULL_BLOCK_ID: it never holds a request's state), so
`num_blocks - 1` are usable. A block is *held* while some request references it
(ref_cnt > 0) and *free* otherwise; a free block may still be *cached* (it has a
hash, a later request with the same prefix can take it back) until it is
reused for something else, which evicts it.

The rules are vLLM 0.32's `BlockPool` (vllm/v1/core/block_pool.py):
- full blocks are hashed as vLLM hashes them (`hash_block_tokens` chained over
  the prompt: sha256 of the pickled (parent, tokens, None), the default
  `prefix_caching_hash_algo`; kv_wire.py, pinned to vLLM by tests), so a hit
  needs the same tokens in every earlier block;
- a hit is the longest run of cached leading blocks, at most `max_hit_tokens`
  (callers pass num_tokens - 1: the last token is always computed);
- freed blocks return to the free queue, unhashed ones at the front (reused
  first), hashed ones at the back in the order given (callers free a request's
  blocks tail first, so its tail is evicted first): eviction is LRU;
- several blocks may carry the same hash (two requests computed the same prefix
  at once); each is stored and removed on its own;
- events: `BlockStored` when full blocks get their hash (one event per call,
  with the parent's hash and the blocks' tokens), `BlockRemoved` per evicted
  block, `AllBlocksCleared` on reset, in vLLM's wire format (kv_wire.py),
  hashes converted as vLLM converts them.

One pool per instance: a block stands for `block_size` tokens of every state
component of the model (cluster/sim/cost.py). Its size (`sim.kv_blocks`, else
the cost model's `kv_capacity_blocks`) counts the full and compressed
components, which hold every block of a request; window and state components
hold only a request's last few blocks (the window's, the state's slot), so, as
in the cost model, they do not count against it. How many bytes a block is per
component, and which blocks of each component move, is the cost model's
business (payload.py and consumer.py use it), not the pool's.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdcluster.cluster.sim.kv_wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    block_hash,
    external_hashes,
    int_block_hashes,
)

NULL_BLOCK_ID = 0


class OutOfBlocks(RuntimeError):
    """The pool cannot give that many blocks (the caller preempts or waits)."""


def hash_blocks(token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """vLLM's chained hashes of every full block of `token_ids`, extending `known`
    (the hashes of its first len(known) blocks, computed before)."""
    out = list(known)
    parent = out[-1] if out else None
    for start in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None



class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, events: bool = True):
        assert num_blocks >= 2, f"a pool of {num_blocks} blocks has none besides the null block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks are made when first handed out (a 910C instance has 80K of them): blocks[i] is
        # block i for i < len(blocks), and blocks len(blocks).. num_blocks - 1 were never used.
        self.blocks = [Block(NULL_BLOCK_ID)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # The free queue, in eviction order (first: next to reuse), as vLLM's one list in three
        # parts: unhashed blocks freed since (they go first), the never-used ones in id order,
        # then every block freed with its hash, in the order freed (touch takes one out).
        self._front: deque[Block] = deque()
        self._free: OrderedDict[int, Block] = OrderedDict()
        # Every block (free or held) a prefix can hit, by hash: the first one cached with it (find_hit's
        # pick), and the later ones, in the order cached (two requests computed one prefix at once).
        # Most hashes have one block: they need no map of their own.
        self._first: dict[BlockHash, Block] = {}
        self._more: dict[BlockHash, dict[int, Block]] = {}
        self._events_on = events
        self._int_hashes = int_block_hashes()  # the events' hash format, read once
        self._events: list[KvCacheEvent] = []

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        return len(self._front) + self.num_blocks - len(self.blocks) + len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - 1 - self.num_free

    @property
    def usage(self) -> float:
        """Held blocks / usable blocks (cached-but-free blocks count as free, as in vLLM)."""
        return self.num_held / (self.num_blocks - 1)

    @property
    def num_cached(self) -> int:
        return len(self._first) + sum(len(v) for v in self._more.values())

    # ------------------------------------------------------------------ prefix cache

    def find_hit(self, block_hashes: Sequence[BlockHash], max_hit_tokens: int) -> list[Block]:
        """The cached blocks of the longest cached prefix, at most `max_hit_tokens`
        long (not yet referenced: `touch` them to keep them)."""
        hit = list(map(self._first.get, block_hashes[:max(0, max_hit_tokens) // self.block_size]))
        try:
            return hit[:hit.index(None)]
        except ValueError:
            return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        """A request takes these (hit) blocks: a free one leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """`n` fresh blocks from the front of the free queue, evicting their cached hashes."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks - 1}")
        out = [self._front.popleft() for _ in range(min(n, len(self._front)))]  # unhashed: nothing to evict
        for b in out:
            b.ref_cnt = 1
        start = len(self.blocks)
        if len(out) < n and start < self.num_blocks:  # never used: made now
            fresh = [Block(i, 1) for i in range(start, min(start + n - len(out), self.num_blocks))]
            self.blocks += fresh
            out += fresh
        while len(out) < n:
            _, b = self._free.popitem(last=False)
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache_full_blocks(self, blocks: Sequence[Block], block_hashes: Sequence[BlockHash], first: int, end: int,
                          token_ids: Sequence[int]) -> None:
        """Blocks `first..end-1` of a request (its block table `blocks`, whose chained hashes
        are `block_hashes`, over `token_ids`) are full now: make them hittable."""
        if end <= first:
            return
        assert len(block_hashes) >= end and len(blocks) >= end, (
            f"caching blocks {first}..{end} of a request with {len(blocks)} blocks and "
            f"{len(block_hashes)} hashes: hash the tokens before caching their blocks")
        new, hashes = blocks[first:end], block_hashes[first:end]
        for b, h in zip(new, hashes):
            assert b.block_hash is None, f"block {b.block_id} cached twice: the caller's cached count is off"
            b.block_hash = h
        if self._first.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes):
            self._first.update(zip(hashes, new))  # the usual case: hashes no block had, at once
        else:
            for b, h in zip(new, hashes):
                if h in self._first:
                    self._more.setdefault(h, {})[b.block_id] = b
                else:
                    self._first[h] = b
        if self._events_on:
            parent = external_hashes(block_hashes[first - 1:first], self._int_hashes)[0] if first > 0 else None
            bs = self.block_size
            tokens = token_ids[first * bs:end * bs]
            self._events.append(BlockStored(
                block_hashes=external_hashes(hashes, self._int_hashes),
                parent_block_hash=parent, token_ids=tokens if isinstance(tokens, list) else list(tokens),
                block_size=bs, lora_id=None, medium=MEDIUM_GPU, lora_name=None, group_idx=0))

    def free(self, ordered: Iterable[Block]) -> None:
        """Drop one reference to each block; at zero a block becomes free. Pass a request's
        blocks tail first: among blocks freed together the first is evicted first."""
        evict_first, evict_last = [], []
        for b in ordered:
            assert b.ref_cnt > 0, f"block {b.block_id} freed more often than taken"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (evict_first if b.block_hash is None else evict_last).append(b)
        self._front.extendleft(reversed(evict_first))  # unhashed: reused before any cached block
        for b in evict_last:
            self._free[b.block_id] = b

    def reset(self) -> bool:
        """Forget every cached hash; False (nothing changed) while any block is held, as vLLM."""
        if self.num_held:
            return False
        for b in self.blocks:
            b.block_hash = None
        self._first.clear()
        self._more.clear()
        if self._events_on:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvCacheEvent]:
        out, self._events = self._events, []
        return out

    def _evict(self, b: Block) -> None:
        h = b.block_hash
        more = self._more.get(h)
        if self._first[h] is b:  # the next one cached with its hash (if any) becomes the pick
            if more:
                self._first[h] = more.pop(next(iter(more)))
            else:
                del self._first[h]
        else:
            del more[b.block_id]
        if more is not None and not more:
            del self._more[h]
        if self._events_on:
            self._events.append(BlockRemoved(block_hashes=external_hashes([h], self._int_hashes),
                                             medium=MEDIUM_GPU, group_idx=0))
        b.block_hash = None

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        queue = [b.block_id for b in self._front] + list(self._free)
        free_ids = set(queue) | set(range(len(self.blocks), self.num_blocks))
        assert self.null_block.ref_cnt == 0 and NULL_BLOCK_ID not in free_ids, "the null block was handed out"
        assert len(set(queue)) == len(queue), "a block twice in the free queue"
        assert all(b.block_hash is None for b in self._front), "a hashed block among the unhashed free ones"
        held = {b.block_id for b in self.blocks[1:] if b.ref_cnt > 0}
        assert not free_ids & held, f"blocks both free and held: {sorted(free_ids & held)[:8]}"
        assert len(free_ids) + len(held) == self.num_blocks - 1, (
            f"free {len(free_ids)} + held {len(held)} != {self.num_blocks - 1} usable blocks: a block leaked")
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        for h, b in self._first.items():
            assert b is self.blocks[b.block_id] and b.block_hash == h, (
                f"hash map says block {b.block_id} holds {h.hex()[:12]}, the block says otherwise")
        for h, more in self._more.items():
            assert more and h in self._first, f"later blocks of hash {h.hex()[:12]} without a first one"
            for block_id, b in more.items():
                assert b is self.blocks[block_id] and b.block_hash == h, (
                    f"hash map says block {block_id} holds {h.hex()[:12]}, the block says otherwise")
        hashed = sum(b.block_hash is not None for b in self.blocks)
        assert hashed == self.num_cached, f"{hashed} blocks have a hash, the map has {self.num_cached}"
