"""The simulated engine's KV block pool and prefix cache, with vLLM's rules.

A fixed number of blocks of `block_size` tokens. Block 0 is the null block, as in
vLLM (transfer/plan.NULL_BLOCK_ID: it never holds a request's state), so
`num_blocks - 1` are usable. Blocks are ids (a request's block table: a list of
them). A block is *held* while some request references it (its reference count
> 0) and *free* otherwise; a free block may still be *cached* (it has a
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

Per-block state is in arrays (reference counts, hashed or not, place in the free
queue), so that taking a 1,024-block hit and freeing a request's blocks are a few
array operations rather than a Python loop over blocks: a C90 replay touches and
frees ~2.6M blocks (each D and P takes a 928-block family prefix per request).
"""

from __future__ import annotations

import array
import functools
import itertools
import operator
from collections.abc import Iterable, Sequence

import numpy as np

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
from pdcluster.transfer.plan import NULL_BLOCK_ID

_is_block = functools.partial(operator.is_not, None)  # find_hit's "cached": a map lookup that found one


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


def _ids(blocks: Iterable[int]) -> np.ndarray:
    return np.fromiter(blocks, dtype=np.int64)


class _FreedQueue:
    """The blocks freed with a hash, in the order freed (the free queue's last part): eviction
    takes the oldest. Entries are appended to an array and left behind when a block is taken
    back (touched) or freed again: an entry is live iff the block's `pos` is its index. Dead
    entries are dropped when the array is full (copying the live ones to its start)."""

    def __init__(self, num_blocks: int):
        self.pos = np.full(num_blocks, -1, dtype=np.int64)  # a block's live entry; -1: not queued
        self._queue = np.zeros(max(64, num_blocks), dtype=np.int64)
        self._head = self._tail = 0  # entries head..tail-1 are the queue (live or dead)
        self.live = 0

    def push(self, ids: np.ndarray) -> None:
        """Queue these (free, not queued), in this order."""
        n = len(ids)
        if self._tail + n > len(self._queue):
            self._compact(n)
        self._queue[self._tail:self._tail + n] = ids
        self.pos[ids] = np.arange(self._tail, self._tail + n)
        self._tail += n
        self.live += n

    def remove(self, ids: np.ndarray) -> None:
        """Take these (queued) out of the queue."""
        assert (self.pos[ids] >= 0).all(), "a block taken out of the free queue it is not in"
        self.pos[ids] = -1
        self.live -= len(ids)

    def pop(self, n: int) -> list[int]:
        """The n oldest, taken out."""
        assert n <= self.live, f"{n} blocks asked of {self.live} queued"
        out: list[int] = []
        while len(out) < n:
            need = n - len(out)
            end = min(self._tail, self._head + 2 * need + 64)
            window = self._queue[self._head:end]
            live = np.flatnonzero(self.pos[window] == np.arange(self._head, end))[:need]
            out += window[live].tolist()
            self._head = self._head + int(live[-1]) + 1 if len(live) == need else end  # dead ones skipped
        self.remove(np.array(out, dtype=np.int64))
        return out

    def _compact(self, room: int) -> None:
        entries = self._queue[self._head:self._tail]
        kept = entries[self.pos[entries] == np.arange(self._head, self._tail)]
        if len(kept) + room > len(self._queue):
            self._queue = np.zeros(2 * (len(kept) + room), dtype=np.int64)
        self._queue[:len(kept)] = kept
        self.pos[kept] = np.arange(len(kept))
        self._head, self._tail = 0, len(kept)

    def order(self) -> list[int]:
        """The live entries, oldest first (checks)."""
        entries = self._queue[self._head:self._tail]
        return entries[self.pos[entries] == np.arange(self._head, self._tail)].tolist()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, events: bool = True, int_hashes: bool | None = None):
        """`int_hashes`: events carry hashes as vLLM's 64-bit ints (None: as the environment says,
        VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), else as the pool's keys."""
        assert num_blocks >= 2, f"a pool of {num_blocks} blocks has none besides the null block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Per block: its references and whether it is hashed, each one buffer seen two ways: an
        # array of Python ints for a step's few blocks, a numpy array for a request's thousand.
        self._refs = array.array("q", bytes(8 * num_blocks))
        self._ref = np.frombuffer(self._refs, dtype=np.int64)
        self._flags = bytearray(num_blocks)
        self._hashed = np.frombuffer(self._flags, dtype=bool)
        self._hash: list[BlockHash | None] = [None] * num_blocks  # each block's hash, if cached
        # The free queue, in eviction order (first: next to reuse), as vLLM's one list in three
        # parts: unhashed blocks freed since (they go first), the never-used ones in id order,
        # then every block freed with its hash, in the order freed (touch takes one out).
        self._front: list[int] = []  # the first part, reversed: its last block is reused first
        self._fresh = NULL_BLOCK_ID + 1  # the second: blocks _fresh..num_blocks - 1
        self._freed = _FreedQueue(num_blocks)
        # Every block (free or held) a prefix can hit, by hash: the first one cached with it (find_hit's
        # pick), and the later ones, in the order cached (two requests computed one prefix at once).
        # Most hashes have one block: they need no map of their own.
        self._first: dict[BlockHash, int] = {}
        self._more: dict[BlockHash, dict[int, None]] = {}
        self._events_on = events
        self._int_hashes = int_block_hashes() if int_hashes is None else int_hashes  # read once
        self._events: list[KvCacheEvent] = []
        self.evictions = 0  # cached blocks reused for new ones (their prefix no longer hittable)

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        return len(self._front) + self.num_blocks - self._fresh + self._freed.live

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

    def ref_cnt(self, block: int) -> int:
        return self._refs[block]

    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash[block]

    # ------------------------------------------------------------------ prefix cache

    def find_hit(self, block_hashes: Sequence[BlockHash], max_hit_tokens: int) -> list[int]:
        """The cached blocks of the longest cached prefix, at most `max_hit_tokens`
        long (not yet referenced: `touch` them to keep them)."""
        n = max(0, max_hit_tokens) // self.block_size
        return list(itertools.takewhile(_is_block, map(self._first.get, itertools.islice(block_hashes, n))))

    def touch(self, blocks: Sequence[int]) -> None:
        """A request takes these (hit, distinct) blocks: a free one leaves the free queue."""
        ids = _ids(blocks)
        self._take(ids, self._ref[ids])

    def admit(self, hit: list[int], new: int) -> list[int] | None:
        """A request's blocks, all or nothing (vLLM's allocate_slots): its hit (find_hit's) taken,
        then `new` fresh ones; None, the pool as it was, if it has not that many free (taking the
        hit's free blocks takes them from the free queue too)."""
        ids = _ids(hit)
        refs = self._ref[ids]
        if new + int(np.count_nonzero(refs == 0)) > self.num_free:
            return None
        self._take(ids, refs)
        return hit + self.allocate(new)

    def _take(self, ids: np.ndarray, refs: np.ndarray) -> None:
        was_free = ids[refs == 0]
        if len(was_free):
            self._freed.remove(was_free)  # a hit is cached, so a free one is in the freed part
        self._ref[ids] = refs + 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks from the front of the free queue, evicting their cached hashes."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks - 1}")
        k = min(n, len(self._front))
        out = self._front[len(self._front) - k:][::-1]  # unhashed: nothing to evict
        del self._front[len(self._front) - k:]
        fresh = min(n - k, self.num_blocks - self._fresh)
        out += range(self._fresh, self._fresh + fresh)
        self._fresh += fresh
        if len(out) < n:
            evicted = self._freed.pop(n - len(out))
            for b in evicted:
                if self._hash[b] is not None:  # (unhashed since a reset)
                    self._evict(b)
            out += evicted
        refs = self._refs
        for b in out:
            refs[b] = 1
        return out

    def cache_full_blocks(self, blocks: Sequence[int], block_hashes: Sequence[BlockHash], first: int, end: int,
                          token_ids: Sequence[int]) -> None:
        """Blocks `first..end-1` of a request (its block table `blocks`, whose chained hashes
        are `block_hashes`, over `token_ids`) are full now: make them hittable."""
        if end <= first:
            return
        assert len(block_hashes) >= end and len(blocks) >= end, (
            f"caching blocks {first}..{end} of a request with {len(blocks)} blocks and "
            f"{len(block_hashes)} hashes: hash the tokens before caching their blocks")
        new, hashes = blocks[first:end], block_hashes[first:end]
        hash_of, flags = self._hash, self._flags
        for b, h in zip(new, hashes):
            assert hash_of[b] is None, f"block {b} cached twice: the caller's cached count is off"
            hash_of[b] = h
            flags[b] = 1
        if self._first.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes):
            self._first.update(zip(hashes, new))  # the usual case: hashes no block had, at once
        else:
            for b, h in zip(new, hashes):
                if h in self._first:
                    self._more.setdefault(h, {})[b] = None
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

    def free(self, ordered: Iterable[int]) -> None:
        """Drop one reference to each block (distinct blocks: a request's); at zero a block
        becomes free. Pass a request's blocks tail first: among blocks freed together the first
        is evicted first."""
        ids = _ids(ordered)
        if not len(ids):
            return
        refs = self._ref[ids] - 1
        assert refs.min() >= 0, f"blocks {ids[refs < 0][:8].tolist()} freed more often than taken"
        self._ref[ids] = refs
        now_free = ids[refs == 0]
        hashed = self._hashed[now_free]
        self._front += now_free[~hashed][::-1].tolist()  # unhashed: reused before any cached block
        if hashed.any():
            self._freed.push(now_free[hashed])

    def reset(self) -> bool:
        """Forget every cached hash; False (nothing changed) while any block is held, as vLLM."""
        if self.num_held:
            return False
        self._hash = [None] * self.num_blocks
        self._hashed[:] = False  # (the flags' buffer, seen as numpy)
        self._first.clear()
        self._more.clear()
        if self._events_on:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvCacheEvent]:
        out, self._events = self._events, []
        return out

    def _evict(self, b: int) -> None:
        self.evictions += 1
        h = self._hash[b]
        more = self._more.get(h)
        if self._first[h] == b:  # the next one cached with its hash (if any) becomes the pick
            if more:
                self._first[h] = next(iter(more))
                del more[self._first[h]]
            else:
                del self._first[h]
        else:
            del more[b]
        if more is not None and not more:
            del self._more[h]
        if self._events_on:
            self._events.append(BlockRemoved(block_hashes=external_hashes([h], self._int_hashes),
                                             medium=MEDIUM_GPU, group_idx=0))
        self._hash[b] = None
        self._flags[b] = 0

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        queue = self._front[::-1] + self._freed.order()
        free_ids = set(queue) | set(range(self._fresh, self.num_blocks))
        assert self._ref[NULL_BLOCK_ID] == 0 and NULL_BLOCK_ID not in free_ids, "the null block was handed out"
        assert len(set(queue)) == len(queue), "a block twice in the free queue"
        assert all(self._hash[b] is None for b in self._front), "a hashed block among the unhashed free ones"
        assert (self._ref[self._fresh:] == 0).all() and not self._hashed[self._fresh:].any(), (
            "a never-used block is referenced or hashed")
        held = set(np.flatnonzero(self._ref > 0).tolist())
        assert not free_ids & held, f"blocks both free and held: {sorted(free_ids & held)[:8]}"
        assert len(free_ids) + len(held) == self.num_blocks - 1, (
            f"free {len(free_ids)} + held {len(held)} != {self.num_blocks - 1} usable blocks: a block leaked")
        assert (self._ref >= 0).all(), "negative ref count"
        assert self._freed.live == len(self._freed.order()), "the freed part's count drifted"
        for h, b in self._first.items():
            assert self._hash[b] == h, f"hash map says block {b} holds {h.hex()[:12]}, the block says otherwise"
        for h, more in self._more.items():
            assert more and h in self._first, f"later blocks of hash {h.hex()[:12]} without a first one"
            for b in more:
                assert self._hash[b] == h, f"hash map says block {b} holds {h.hex()[:12]}, the block says otherwise"
        hashed = sum(h is not None for h in self._hash)
        assert hashed == self.num_cached == int(self._hashed.sum()), (
            f"{hashed} blocks have a hash, the map has {self.num_cached}, the flags {int(self._hashed.sum())}")
