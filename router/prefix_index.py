"""Which prompt blocks each instance's prefix cache holds, from vLLM's KV cache events.

First piece of issue 6 (prefix-aware routing); nothing routes by it yet.

The router hashes prompts itself (`chain_hashes`: each full block's hash covers
its tokens and its parent's hash, as vLLM's do), so it never depends on the
engine's hash function or seed. vLLM's `BlockStored` events carry the parent's
engine hash and the block's tokens, which is enough to translate each engine
hash into the router's: `InstanceIndex.apply` keeps that map per instance.

Events come in numbered batches. A batch that skips a number, or an instance
that restarted (its numbering starts again), makes the index `stale`: it is
cleared and says so until the instance's cache is replayed or reset, rather
than routing on guesses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

RouterHash = bytes
ROOT: RouterHash = b"\0" * 32  # the parent of a prompt's first block


def block_hash(parent: RouterHash, tokens: Sequence[int]) -> RouterHash:
    """Pure: a block's identity is its parent's and its own tokens."""
    h = hashlib.sha256(parent)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[RouterHash]:
    """The hashes of a prompt's full blocks, in order (a partial last block has none, as in vLLM)."""
    out, parent = [], ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class BlockStored:
    """vLLM's BlockStored, as the router needs it: engine hashes of consecutive blocks."""

    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]  # all the blocks' tokens, block after block
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int | bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class InstanceIndex:
    block_size: int
    # engine hash -> router hash, for every block the instance holds (its cache's own keys).
    _held: dict[int | bytes, RouterHash] = field(default_factory=dict)
    # router hash -> how many of the instance's blocks have it (0 never stored)
    _count: dict[RouterHash, int] = field(default_factory=dict)
    next_seq: int | None = None  # the batch number expected next; None: take the first as it comes
    stale: bool = False  # a batch was missed: the index is empty and untrusted until resynced

    def apply(self, seq: int, events: Sequence[KvEvent]) -> bool:
        """Apply batch `seq`. False (and the index cleared, stale) if batches were missed."""
        if self.next_seq is not None and seq != self.next_seq:
            self.clear()
            self.stale, self.next_seq = True, seq + 1
            return False
        self.next_seq = seq + 1
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._drop(h)
            else:
                self.clear()
        return True

    def _stored(self, ev: BlockStored) -> None:
        assert ev.block_size == self.block_size, (
            f"engine blocks of {ev.block_size} tokens, index of {self.block_size}: mismatched config")
        if ev.parent_block_hash is None:
            parent = ROOT
        elif ev.parent_block_hash in self._held:
            parent = self._held[ev.parent_block_hash]
        else:  # a parent the index never saw: it cannot place the blocks in a prompt's chain
            return
        for i, h in enumerate(ev.block_hashes):
            parent = block_hash(parent, ev.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if h not in self._held:
                self._held[h] = parent
                self._count[parent] = self._count.get(parent, 0) + 1

    def _drop(self, engine_hash: int | bytes) -> None:
        router_hash = self._held.pop(engine_hash, None)
        if router_hash is None:
            return
        self._count[router_hash] -= 1
        if not self._count[router_hash]:
            del self._count[router_hash]

    def clear(self) -> None:
        self._held.clear()
        self._count.clear()

    def resynced(self) -> None:
        """The instance's cache was reset (or replayed in full): trust the index again."""
        self.stale = False

    def matched_blocks(self, hashes: Sequence[RouterHash]) -> int:
        """How many leading blocks of a prompt (its chain_hashes) this instance holds."""
        n = 0
        for h in hashes:
            if h not in self._count:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._held)
