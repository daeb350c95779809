"""The simulated engine's block pool: vLLM's prefix-cache rules, its events, its invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

from pdcluster.cluster.sim.block_pool import BlockPool, OutOfBlocks, hash_blocks
from pdcluster.cluster.sim.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored

init_none_hash(sha256)  # as a vLLM engine does at start: the root of every chain

BS = 4


def pool(num_blocks: int = 9) -> BlockPool:
    return BlockPool(num_blocks, BS)


def run_request(p: BlockPool, tokens: list[int]) -> tuple[list, int]:
    """Admit a prompt as vLLM does (hit, then fresh blocks, cache its full blocks); return
    its block table (tail first, ready to free) and the hit in tokens."""
    hashes = hash_blocks(tokens, BS)
    hit = p.find_hit(hashes, len(tokens) - 1)
    p.touch(hit)
    table = hit + p.allocate(-(-len(tokens) // BS) - len(hit))
    p.cache_full_blocks(table, hashes, len(hit), len(hashes), tokens)
    return table[::-1], len(hit) * BS


def test_hashes_are_vllms_chained_hashes():
    tokens = list(range(10))
    h = hash_blocks(tokens, BS)
    assert len(h) == 2  # the partial third block has none
    assert h[0] == hash_block_tokens(sha256, None, tokens[0:4])
    assert h[1] == hash_block_tokens(sha256, h[0], tokens[4:8])
    assert hash_blocks(tokens, BS, known=h[:1]) == h
    # A change in block 0 changes every later hash (the chain), not just block 0's.
    changed = hash_blocks([99] + tokens[1:], BS)
    assert changed[0] != h[0] and changed[1] != h[1]


def test_hit_is_the_longest_cached_prefix_never_the_whole_prompt():
    p = pool()
    a = list(range(12))  # exactly 3 full blocks
    table, hit = run_request(p, a)
    assert hit == 0
    p.free(table)
    # Same prompt: the last token must be computed, so only 2 of its 3 blocks hit.
    table, hit = run_request(p, a)
    assert hit == 8
    p.free(table)
    # Shares block 0 only.
    table, hit = run_request(p, a[:4] + [50, 51, 52, 53, 54])
    assert hit == 4
    p.free(table)
    p.check_integrity()


def test_ref_counts_share_blocks_between_requests():
    p = pool()
    t1, _ = run_request(p, list(range(9)))
    t2, hit = run_request(p, list(range(8)) + [77])
    assert hit == 8 and p.num_held == 4  # 2 shared + a tail block each
    p.free(t1)
    assert p.num_held == 3  # the shared blocks stay held by the second request
    p.free(t2)
    assert p.num_held == 0 and p.usage == 0.0
    p.check_integrity()


def test_lru_evicts_least_recently_freed_cached_blocks_tail_first():
    p = pool(5)  # 4 usable blocks
    ta, _ = run_request(p, list(range(8)) + [0])  # 2 cached blocks + unhashed tail
    p.free(ta)
    tb, _ = run_request(p, list(range(100, 104)) + [0])  # its tail reuses a's unhashed one
    p.free(tb)
    p.take_events()
    # Free queue now: a1, a0, b0 (hashed, in free order: a's tail first), unhashed blocks in front.
    assert p.num_free == 4
    t, _ = run_request(p, list(range(200, 208)))  # needs 2 blocks: the unhashed one, then a's tail block
    removed = [e for e in p.take_events() if isinstance(e, BlockRemoved)]
    a_hashes = hash_blocks(list(range(8)), BS)
    assert [e.block_hashes for e in removed] == [[maybe_convert_block_hash(a_hashes[1])]]
    # a's first block is still cached; a's prompt now hits 1 block.
    assert len(p.find_hit(a_hashes, 8)) == 1
    p.free(t)
    p.check_integrity()


def test_touching_a_cached_free_block_protects_it_from_eviction():
    p = pool(3)  # 2 usable
    t, _ = run_request(p, list(range(4)) + [9])
    p.free(t)
    h = hash_blocks(list(range(4)), BS)
    hit = p.find_hit(h, 4)
    p.touch(hit)
    assert p.num_free == 1
    with pytest.raises(OutOfBlocks):
        p.allocate(2)
    fresh = p.allocate(1)
    assert fresh[0] != hit[0] and p.find_hit(h, 4) == hit
    p.free(fresh + hit)
    p.check_integrity()


def test_events_in_vllms_wire_classes():
    p = pool()
    tokens = list(range(10))
    table, _ = run_request(p, tokens)
    (stored,) = p.take_events()
    h = hash_blocks(tokens, BS)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [maybe_convert_block_hash(x) for x in h]
    assert stored.parent_block_hash is None and stored.token_ids == tokens[:8] and stored.block_size == BS
    # A longer prompt of the same family stores only its new blocks, naming their parent.
    p.free(table)
    longer = tokens[:8] + list(range(50, 58))
    table, hit = run_request(p, longer)
    (stored,) = p.take_events()
    assert hit == 8 and stored.parent_block_hash == maybe_convert_block_hash(h[1])
    assert stored.token_ids == longer[8:16]
    p.free(table)
    assert p.reset() is True
    assert isinstance(p.take_events()[-1], AllBlocksCleared)
    assert p.num_cached == 0 and p.find_hit(h, 8) == []
    p.check_integrity()


def test_reset_refused_while_blocks_are_held():
    p = pool()
    t, _ = run_request(p, list(range(8)))
    assert p.reset() is False and p.num_cached == 2
    p.free(t)
    assert p.reset() is True


def test_duplicate_hashes_are_stored_and_removed_one_by_one():
    p = pool(5)
    tokens = list(range(4))
    h = hash_blocks(tokens, BS)
    # Two requests compute the same block at once (neither hit the other's).
    b1, b2 = p.allocate(1), p.allocate(1)
    p.cache_full_blocks(b1, h, 0, 1, tokens)
    p.cache_full_blocks(b2, h, 0, 1, tokens)
    assert p.num_cached == 2
    p.free(b1 + b2)
    p.take_events()
    p.allocate(4)  # evicts both
    removed = [e for e in p.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2 and p.num_cached == 0
    p.check_integrity()


def test_check_integrity_catches_a_leak_and_a_double_state():
    p = pool()
    p._ref[p.allocate(2)[0]] = 0  # a held block that lost its reference without being freed
    with pytest.raises(AssertionError, match="leaked"):
        p.check_integrity()
    q = pool()
    q._freed.push(np.array(q.allocate(1)))  # held and in the free queue
    with pytest.raises(AssertionError, match="both free and held"):
        q.check_integrity()


class PlainPool:
    """vLLM's rules as plainly as they can be written (one list for the free queue), to check
    the pool's arrays and lazy queue against."""

    def __init__(self, num_blocks: int):
        self.ref, self.hash = [0] * num_blocks, [None] * num_blocks
        self.queue = list(range(1, num_blocks))  # eviction order: next to reuse first
        self.cached: dict = {}  # hash -> its blocks, in the order cached
        self.removed: list = []

    def find_hit(self, hashes, max_tokens):
        out = []
        for h in hashes[:max(0, max_tokens) // BS]:
            if not self.cached.get(h):
                break
            out.append(self.cached[h][0])
        return out

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def allocate(self, n):
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            if self.hash[b] is not None:
                self.cached[self.hash[b]].remove(b)
                if not self.cached[self.hash[b]]:
                    del self.cached[self.hash[b]]
                self.removed.append(self.hash[b])
                self.hash[b] = None
            self.ref[b] = 1
        return out

    def cache(self, blocks, hashes):
        for b, h in zip(blocks, hashes):
            self.hash[b] = h
            self.cached.setdefault(h, []).append(b)

    def free(self, ordered):
        unhashed, hashed = [], []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (unhashed if self.hash[b] is None else hashed).append(b)
        self.queue = unhashed + self.queue + hashed


def test_the_pool_follows_the_plain_rules_through_a_long_random_run():
    # Small pool, few prefixes: hits, shared blocks, evictions, duplicate hashes (two requests
    # computing one prefix at once), and the lazy queue dropping its dead entries many times.
    rng = random.Random(7)
    p, plain = pool(41), PlainPool(41)
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(5)]
    held = []
    for _ in range(3_000):
        if held and (rng.random() < 0.45 or p.num_free < 12):
            table = held.pop(rng.randrange(len(held)))[::-1]
            p.free(table)
            plain.free(table)
        else:
            tokens = rng.choice(prefixes)[:rng.randrange(4, 17)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
            hashes = hash_blocks(tokens, BS)
            hit = p.find_hit(hashes, len(tokens) - 1)
            assert hit == plain.find_hit(hashes, len(tokens) - 1)
            needed = -(-len(tokens) // BS) - len(hit)
            if needed + sum(plain.ref[b] == 0 for b in hit) > len(plain.queue):
                assert p.admit(hit, needed) is None
                continue
            plain.touch(hit)
            table = p.admit(hit, needed)
            assert table == hit + plain.allocate(needed)
            if rng.random() < 0.8:  # else freed uncached, as a request preempted before its step
                p.cache_full_blocks(table, hashes, len(hit), len(hashes), tokens)
                plain.cache(table[len(hit):len(hashes)], hashes[len(hit):])
            held.append(table)
        assert p.num_free == len(plain.queue) and p.num_cached == sum(map(len, plain.cached.values()))
    removed = [e.block_hashes[0] for e in p.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [maybe_convert_block_hash(h) for h in plain.removed] and len(removed) > 100
    assert len(p._freed._queue) == 64  # its dead entries were dropped (45 times), the array never grew
    p.check_integrity()
