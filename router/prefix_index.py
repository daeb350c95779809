"""Which prompt blocks each instance's prefix cache holds, from vLLM's KV cache events.

The router hashes prompts itself (`chain_hashes`: each full block's hash covers
its tokens and its parent's hash, as vLLM's do), so it never depends on the
engine's hash function or seed. vLLM's `BlockStored` events carry the parent's
engine hash and the block's tokens, which is enough to translate each engine
hash into the router's: `InstanceIndex` keeps that map per instance.

What the index holds is a subset of what the engine holds, never more:
- blocks whose parent the index never saw cannot be placed in a chain and are
  left out (they reappear when the engine stores them again);
- a lost batch (`lost_history`, or `apply` with a seq that skips) clears the
  index and marks it `stale`; later events are still applied, since what they
  say is true, and `stale` ends when the engine's cache is cleared
  (`AllBlocksCleared`) or the instance restarts (`restarted`).
Which events come in which order (gaps, replay, restarts) is the feed's
business (router/kv_events.py); this module only applies them.

Blocks are keyed per KV cache group (`group_idx`): a hybrid model stores the
same engine hash once per group, and removing it from one group must not drop
the others. A prompt's hit is counted as the engine counts it (proto/kv_groups.py), when the
instance said what its groups are (`groups`, from InstanceInfo.kv_groups): every full-attention
group's run of blocks, cut back until each sliding-window group holds the blocks of its window
before the hit's end (a window group's older blocks go first when the engine evicts: a window
group's run from the prompt's start says nothing). Without them, group 0's run. The engine's own pool (medium GPU or unset; vLLM calls its main pool
GPU on every device) and its host tier (medium CPU: P's host tier, or vLLM's CPU
offloading) are indexed apart (`host`): a prompt's hit there is the device's run
of blocks, then the tier's run past it (`tier_matched_blocks`), which the engine
loads instead of computing. Other media (disk, remote) are skipped.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdcluster.proto.kv_event_wire import HOST_MEDIUM, BlockRemoved, BlockStored, EngineHash, KvEvent
from pdcluster.proto.kv_groups import KvGroup, cut_to_windows

RouterHash = bytes
ROOT: RouterHash = b"\0" * 32  # the parent of a prompt's first block
PRIMARY_MEDIA = ("GPU", None)  # vLLM's MEDIUM_GPU: the engine's own KV pool, whatever the device

assert array.array("I").itemsize == 4, "token bytes assume a 4-byte unsigned C int"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian uint32, 4 bytes each (what every block hash covers).
    Raises OverflowError for a token outside 0..2**32-1."""
    a = array.array("I", tokens)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def _hash(parent: RouterHash, data: bytes | memoryview, extra_keys: tuple[Any, ...] | None) -> RouterHash:
    h = hashlib.sha256(parent)
    h.update(data)
    if extra_keys is not None:  # LoRA, multimodal, cache_salt: a different block from the same tokens
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def block_hash(parent: RouterHash, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> RouterHash:
    """Pure: a block's identity is its parent's, its own tokens, and vLLM's extra keys if any."""
    return _hash(parent, token_bytes(tokens), extra_keys)


def chain_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[RouterHash] = ()) -> list[RouterHash]:
    """The hashes of a prompt's full blocks, in order (a partial last block has none, as in vLLM).
    `known`: the hashes of its first len(known) blocks, worked out before (only the rest is hashed).

    One conversion of the whole prompt, then one sha256 per block: 1,024 blocks of
    128 tokens take ~2 ms."""
    return _extend_chain(known, token_ids, len(token_ids), block_size)


def hittable_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[RouterHash] = ()) -> list[RouterHash]:
    """The blocks of a prompt an engine can serve from its cache: vLLM always computes
    the last prompt token (its hit is at most len - 1 tokens), so a prompt that ends
    on a block boundary cannot hit its last block. `known`: as chain_hashes'."""
    hittable = max(len(token_ids) - 1, 0)
    return _extend_chain(known[:hittable // block_size], token_ids, hittable, block_size)


def _extend_chain(known: Sequence[RouterHash], token_ids: Sequence[int], end: int, block_size: int) -> list[RouterHash]:
    """`known` extended by the hashes of the full blocks of token_ids[:end] past them."""
    assert block_size > 0, f"block_size {block_size}: must be positive"
    return extend_chain_bytes(known, token_bytes(token_ids[len(known) * block_size:end]), block_size)


def extend_chain_bytes(known: Sequence[RouterHash], data: bytes, block_size: int) -> list[RouterHash]:
    """`known` extended by the hashes of the full blocks of `data`, the token_bytes of the
    tokens past them (for a caller that reads those bytes for something else too)."""
    data = memoryview(data)
    step = 4 * block_size
    out, parent = list(known), known[-1] if known else ROOT
    for start in range(0, len(data) - step + 1, step):
        parent = _hash(parent, data[start:start + step], None)
        out.append(parent)
    return out




REMOVED_KEPT = 1 << 16  # removals an index remembers (InstanceIndex._removed_at): ~8 MB at most


@dataclass
class InstanceIndex:
    block_size: int
    # Per KV cache group: engine hash -> router hash, for every block the instance holds (its cache's own keys).
    _held: dict[int, dict[EngineHash, RouterHash]] = field(default_factory=dict)
    # Per group: router hash -> how many of the instance's blocks have it (absent: none; never 0).
    # A Counter, so that an event's blocks are counted in one call (Counter.update counts in C).
    _count: dict[int, Counter[RouterHash]] = field(default_factory=dict)
    next_seq: int | None = None  # the batch number expected next; None: take the first as it comes
    stale: bool = False  # history was lost: the index may miss blocks the instance holds
    skipped_events: int = 0  # events it could not use: another medium, or blocks of another size
    removed_blocks: int = 0  # blocks it held that the engine then evicted (BlockRemoved), in all
    clears: int = 0  # times it was emptied (cache reset, restart, lost history): older promises are void
    # Engine hash -> router hash of blocks whose router hash the caller worked out already (the
    # virtual clock hashes every prompt both ways): taken instead of hashing the tokens again.
    known: Mapping[EngineHash, RouterHash] | None = field(default=None, repr=False)
    # The instance's host tier's blocks (medium CPU), kept as this index keeps the device's; None
    # until the first such event. Its parents may be device blocks: a tier's run may start past
    # the device's hit.
    host: InstanceIndex | None = field(default=None, repr=False)
    # The engine's KV-cache groups (InstanceInfo.kv_groups); empty: one full-attention group, 0.
    groups: tuple[KvGroup, ...] = ()
    # Blocks removed lately: router hash -> `removed_blocks` when it last went, the oldest dropped
    # past REMOVED_KEPT. A promise of blocks whose request ended asks whether its block came and
    # went since (router/pending_blocks.py): stored and evicted between two lookups.
    _removed_at: dict[RouterHash, int] = field(default_factory=dict, repr=False)

    def _index_of(self, medium: str | None) -> InstanceIndex | None:
        if medium in PRIMARY_MEDIA:
            return self
        if medium == HOST_MEDIUM:
            if self.host is None:
                self.host = InstanceIndex(self.block_size, known=self.known, groups=self.groups)
            return self.host
        return None

    def apply(self, seq: int, events: Sequence[KvEvent]) -> bool:
        """Apply batch `seq`. False if batches were missed before it: the index is then
        cleared and stale first (the batch itself is still applied)."""
        contiguous = self.next_seq is None or seq == self.next_seq
        if not contiguous:
            self.lost_history()
        self.next_seq = seq + 1
        # Stored blocks whose parent no index holds yet: vLLM announces a hybrid model's groups in
        # its order (Gemma3's and gpt-oss's window group first), so a window group's blocks may name
        # a parent that a later event of the batch brings in another group. Retried after each
        # block placed; dropped at a clear, or at a removal of one of their blocks (never placed
        # past it).
        unplaced: list[tuple[InstanceIndex, BlockStored]] = []
        for ev in events:
            if isinstance(ev, BlockStored | BlockRemoved):
                index = self._index_of(ev.medium)
                if index is None:
                    self.skipped_events += 1
                elif isinstance(ev, BlockStored):
                    if not index._stored(ev, self):
                        unplaced.append((index, ev))
                    elif unplaced:
                        unplaced = [(i, e) for i, e in unplaced if not i._stored(e, self)]
                else:
                    if unplaced:
                        gone = set(ev.block_hashes)
                        unplaced = [(i, e) for i, e in unplaced
                                    if not (i is index and e.group_idx == ev.group_idx and gone & set(e.block_hashes))]
                    for h in ev.block_hashes:
                        index._drop(ev.group_idx, h)
            else:
                unplaced = []
                self.clear()
                self.stale = False  # the engine's cache is empty: known exactly from here
        return contiguous

    def _stored(self, ev: BlockStored, device: InstanceIndex) -> bool:
        """`device`: the instance's device index (self, or the one whose host tier this is), where a
        parent may be too. False: the parent is held nowhere, the blocks are not placed."""
        # vLLM stores blocks of another size for hybrid models (hash-block sized
        # pieces); the router's chain cannot place them.
        if ev.block_size != self.block_size:
            device.skipped_events += 1
            return True
        g, bs = ev.group_idx, self.block_size
        # vLLM leaves out of a window group's event the blocks it already freed (null), yet gives
        # the tokens of the whole range: they are the event's first blocks, skipped here.
        skipped, odd = divmod(len(ev.token_ids), bs)
        skipped -= len(ev.block_hashes)
        assert not odd and skipped >= 0, (
            f"BlockStored with {len(ev.block_hashes)} hashes but {len(ev.token_ids)} tokens "
            f"(block size {bs}): a decoder that mis-reads the event")
        if skipped and not any(i == g for i, *_ in self._full_and_windows()[1]):
            device.skipped_events += 1  # (not a window group this index knows: which were left out is unknown)
            return True
        held = self._held.setdefault(g, {})
        if ev.parent_block_hash is None:
            parent = ROOT
        elif ev.parent_block_hash in held:
            parent = held[ev.parent_block_hash]
        elif ev.parent_block_hash in device._held.get(g, ()):
            parent = device._held[g][ev.parent_block_hash]
        else:  # a window group's parent may have gone from it but not from another group
            held_by = (m for m in (*self._held.values(), *device._held.values()) if ev.parent_block_hash in m)
            parent = next(held_by, {}).get(ev.parent_block_hash)
            if parent is None:  # a parent the index never saw: it cannot place the blocks in a prompt's chain
                return False
        routers = self._router_hashes(ev, parent, skipped)
        count = self._count.setdefault(g, Counter())
        if held.keys().isdisjoint(ev.block_hashes):  # the usual case: every block new, at once
            fresh = dict(zip(ev.block_hashes, routers))
            if len(fresh) == len(routers):
                held.update(fresh)
                count.update(routers)
                return True
        for h, router_hash in zip(ev.block_hashes, routers):
            if h not in held:  # vLLM may announce a block again (a prefix hit in "full" mode)
                held[h] = router_hash
                count[router_hash] += 1
        return True

    def _router_hashes(self, ev: BlockStored, parent: RouterHash, skipped: int = 0) -> list[RouterHash]:
        """The router's hash of each of the event's blocks, the first one's parent being `parent`
        (`skipped`: the event's tokens begin with so many blocks it does not name)."""
        bs = self.block_size
        known = self.known if self.known is not None and not ev.extra_keys and ev.group_idx == 0 else None
        out = list(map(known.get, ev.block_hashes)) if known is not None else [None] * len(ev.block_hashes)
        if None not in out:  # every one known: the same chain of tokens as hashing them would give
            return out
        data = memoryview(token_bytes(ev.token_ids))
        for i in range(skipped):  # (a window's freed blocks: no extra keys, vLLM gives none for them)
            parent = _hash(parent, data[4 * bs * i:4 * bs * (i + 1)], None)
        data = data[4 * bs * skipped:]
        for i, router_hash in enumerate(out):
            if router_hash is None:
                extra = ev.extra_keys[i] if ev.extra_keys else None
                router_hash = out[i] = _hash(parent, data[4 * bs * i:4 * bs * (i + 1)], extra)
            parent = router_hash
        return out

    def _drop(self, group: int, engine_hash: EngineHash) -> None:
        router_hash = self._held.get(group, {}).pop(engine_hash, None)
        if router_hash is None:
            return
        self.removed_blocks += 1
        self._removed_at.pop(router_hash, None)  # (to the end: the latest removal)
        self._removed_at[router_hash] = self.removed_blocks
        if len(self._removed_at) > REMOVED_KEPT:
            del self._removed_at[next(iter(self._removed_at))]
        count = self._count[group]
        count[router_hash] -= 1
        if not count[router_hash]:
            count.pop(router_hash)  # (not del: a Counter's __delitem__ is Python)

    def removed_since(self, block: RouterHash, mark: int) -> bool:
        """Whether a block with this router hash was removed after `removed_blocks` was `mark`."""
        return self._removed_at.get(block, -1) > mark

    def clear(self) -> None:
        self._held.clear()
        self._count.clear()
        self.clears += 1
        if self.host is not None:  # vLLM's reset with its connector's: the tier empties too
            self.host.clear()

    def lost_history(self) -> None:
        """Batches were lost for good: forget everything, say so until the cache is known again."""
        self.clear()
        self.stale = True

    def restarted(self) -> None:
        """A new engine behind the instance (empty cache, numbering from 0): start over, trusted."""
        self.clear()
        self.stale, self.next_seq = False, None

    def matched_blocks(self, hashes: Sequence[RouterHash], group: int | None = None) -> int:
        """How many leading blocks of a prompt (its chain_hashes) this instance holds as a hit (see
        the module docstring), or in `group` alone."""
        return self._hit(hashes, 0) if group is None else self._run(hashes, 0, group)

    def tier_matched_blocks(self, hashes: Sequence[RouterHash], start: int) -> int:
        """How many blocks of the prompt past its first `start` (the device's hit) the host tier
        holds as a hit's run: what the engine would load from it instead of computing."""
        return self.host._hit(hashes, start) if self.host is not None else 0

    def holds(self, block: RouterHash, group: int | None = None) -> bool:
        """Whether it holds the block (in `group`, by default its first full-attention group)."""
        if group is None:
            full, _ = self._full_and_windows()
            group = full[0] if full else 0
        return block in self._count.get(group, ())

    def _run(self, hashes: Sequence[RouterHash], start: int, group: int) -> int:
        count = self._count.get(group)
        if not count:
            return 0
        return len(list(itertools.takewhile(count.__contains__, itertools.islice(hashes, start, None))))  # in C

    def _hit(self, hashes: Sequence[RouterHash], start: int) -> int:
        """Blocks of the prompt from `start` on that make a hit's run; a window group's blocks
        before `start` are the caller's (the device's, for a tier)."""
        full, windows = self._full_and_windows()
        n = min((self._run(hashes, start, g) for g in full), default=max(0, len(hashes) - start))
        return cut_to_windows(n, start * self.block_size, self.block_size, windows,
                              lambda g, i: hashes[i] in self._count.get(g, ()))

    def _full_and_windows(self) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """(full-attention groups, (window group, window, block size)); group 0 alone when the groups are
        unknown or of other block sizes than the router's (DeepSeek-V4's: their blocks are skipped)."""
        if not self.groups or any(g.block_size != self.block_size for g in self.groups):
            return (0,), ()
        return (tuple(i for i, g in enumerate(self.groups) if not g.is_window),
                tuple((i, g.window, g.block_size) for i, g in enumerate(self.groups) if g.is_window))

    def __len__(self) -> int:
        return sum(map(len, self._held.values()))
