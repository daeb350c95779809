"""An instance's host-memory KV tier, worker side (issue 29): the bytes of the blocks the tier's
book (transfer/tier_book.py, on the scheduler side) keeps, copied out of the engine's paged KV
cache and back into it. It does what the book decided and decides nothing.

A kept block is one host tensor per layer of its KV-cache group, keyed like the book's blocks
(group, block hash). `store` copies device blocks out (after the step that computed them: the
blocks must not be reused meanwhile), `load` copies kept blocks into device blocks the engine
allocated for them (before the step that reads them), `evict` frees them. `pin`: page-locked host
memory, so that the copies back to an accelerator run at the link's speed (off on CPU engines,
whose "device" cache is host memory already). The connector's worker (transfer/connector_worker.py)
carries out the orders of transfer/tier_scheduler.py with it.

The cluster-wide pool (issue 29 item 2): a peer reads a run of a prompt's first blocks straight from
this tier over the KV plane (`read_run`: a `PooledRun` that P's KV server serves as a transfer
source, transfer/sources.py). Its blocks are pinned while it lives: an eviction the book orders
meanwhile frees their bytes once the read is over (the book has already counted them free: the
tier holds at most the pinned blocks more than its capacity). The worker thread stores, loads and
evicts; the KV server's threads read: every access to the blocks is under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pdcluster.proto.kv_groups import (
    KvGroup,
    block_hash_index,
    cut_to_windows,
    hash_block_size,
    hit_unit,
    window_blocks,
)
from pdcluster.proto.messages import TierCounts
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.tier_book import BlockKey


class HostTier:
    def __init__(self, kv: PagedKv, pin: bool = False):
        self._kv, self._pin = kv, pin
        self._layers: dict[int, list[str]] = {}  # group -> its layers (parts), in the cache's order
        for info in kv.layers.values():
            self._layers.setdefault(info.group, []).append(info.name)
        self._group_bytes = {g: sum(kv.layers[n].block_bytes for n in names) for g, names in self._layers.items()}
        # Invariant: a key is here with one tensor for each layer of its group, or not at all.
        self._blocks: dict[BlockKey, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()  # guards _blocks, _pins, _evict_later (the worker and the KV server)
        self._pins: Counter[BlockKey] = Counter()  # keys a peer's read holds (never 0: absent instead)
        self._evict_later: set[BlockKey] = set()  # evicted while pinned: freed at the last unpin
        self.counts = TierCounts()  # since it started (held_bytes: see `counted`)

    def block_bytes(self, group: int) -> int:
        """One block of `group` in the tier, all its layers: what the book counts per block."""
        return self._group_bytes[group]

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self.block_bytes(group) for group, _ in self._blocks)

    def counted(self) -> TierCounts:
        """`counts`, with the bytes it holds now."""
        return replace(self.counts, held_bytes=self.nbytes)

    def __contains__(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._blocks and key not in self._evict_later

    def store(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """Copy device blocks `block_ids` into the tier under `keys` (one group: the keys')."""
        group = self._one_group(keys, block_ids)
        copies: dict[BlockKey, dict[str, torch.Tensor]] = {k: {} for k in keys}
        for name in self._layers[group]:
            gathered = self._kv.gather(name, list(block_ids)).cpu()  # one read per layer for all the blocks
            for i, k in enumerate(keys):
                block = torch.empty_like(gathered[i], pin_memory=self._pin)
                copies[k][name] = block.copy_(gathered[i])  # each block its own storage: evicted alone
        with self._lock:
            self._blocks.update(copies)
            self._evict_later.difference_update(copies)  # kept again: a pending eviction is void
        c = self.counts
        self.counts = replace(c, stored_blocks=c.stored_blocks + len(keys),
                              stored_bytes=c.stored_bytes + len(keys) * self.block_bytes(group))

    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        """Copy the kept blocks `keys` into device blocks `block_ids` (KeyError naming one not kept:
        the book and the bytes out of step); the copies' time, in ns, as issued."""
        group = self._one_group(keys, block_ids)
        with self._lock:
            missing = [k for k in keys if k not in self._blocks or k in self._evict_later]
            blocks = [self._blocks.get(k) for k in keys]
        if missing:
            raise KeyError(f"the host tier holds no bytes for {len(missing)} of the {len(keys)} blocks to load "
                           f"(first: group {missing[0][0]}, hash {missing[0][1].hex()[:16]})")
        t0 = time.monotonic_ns()
        for name in self._layers[group]:
            view = self._kv.view(name)
            data = torch.stack([b[name] for b in blocks])
            view.index_copy_(0, torch.tensor(list(block_ids), dtype=torch.long, device=view.device),
                             data.to(view.device, non_blocking=self._pin))
        took_ns = time.monotonic_ns() - t0
        c = self.counts
        self.counts = replace(c, loaded_blocks=c.loaded_blocks + len(keys), load_seconds=c.load_seconds + took_ns / 1e9,
                              loaded_bytes=c.loaded_bytes + len(keys) * self.block_bytes(group))
        return took_ns

    def evict(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                if k in self._pins:
                    self._evict_later.add(k)
                else:
                    self._blocks.pop(k, None)

    # ---------------------------------------------------------------- the pool: peers' reads

    def read_run(self, hashes: Sequence[bytes], groups: Sequence[KvGroup]) -> PooledRun:
        """The run of a prompt's first blocks held as a hit, pinned until the run is closed (it may
        be empty). `hashes` are vLLM's block hashes of the prompt, in prompt order, in blocks of the
        groups' greatest common block size; `groups` the engine's KV-cache groups, in vLLM's order.
        Every full group's blocks from the first, a sliding-window
        group's only those of its window before the run's end (proto/kv_groups.py); a hit is whole
        units of the groups' least common block size, as vLLM's scheduler counts one."""
        sizes = {g: groups[g].block_size for g in self._layers}
        hash_size, unit = hash_block_size(sizes.values()), hit_unit(sizes.values())
        windows = [(g, groups[g].window, sizes[g]) for g in self._layers if groups[g].is_window]
        full = [g for g in self._layers if g not in {w[0] for w in windows}]

        def key(g: int, i: int) -> BlockKey:  # group g's block i: named by the hash of the prefix it ends
            return g, hashes[block_hash_index(i, sizes[g], hash_size)]

        with self._lock:
            def held(g: int, i: int) -> bool:
                k = key(g, i)
                return k in self._blocks and k not in self._evict_later

            n = 0
            while (n + 1) * unit <= len(hashes) * hash_size and all(
                    held(g, i) for g in full for i in range(n * unit // sizes[g], (n + 1) * unit // sizes[g])):
                n += 1
            n = cut_to_windows(n, 0, unit, windows, held)
            blocks = {g: range(n * unit // sizes[g]) for g in full} | {
                g: window_blocks(0, n * unit, size, window) for g, window, size in windows}
            keys = {g: {i: key(g, i) for i in blocks[g]} for g in self._layers}
            for run in keys.values():
                self._pins.update(run.values())
        self.counts = replace(self.counts, served_blocks=self.counts.served_blocks + n)
        return PooledRun(self, keys, n * unit)

    def _gather(self, layer: str, keys: Sequence[BlockKey]) -> torch.Tensor:
        with self._lock:
            blocks = [self._blocks[k][layer] for k in keys]
        return torch.stack(blocks)

    def _unpin(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins[k] -= 1
                if self._pins[k] <= 0:
                    del self._pins[k]
                    if k in self._evict_later:
                        self._evict_later.discard(k)
                        self._blocks.pop(k, None)

    def _one_group(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks: one key per block")
        groups = {g for g, _ in keys}
        if len(groups) != 1 or not groups <= self._layers.keys():
            raise ValueError(f"blocks of KV-cache groups {sorted(groups)}: one call moves one group's, of "
                             f"{sorted(self._layers)}")
        return groups.pop()


@dataclass
class PooledRun:
    """A run of a prompt's first `num_blocks` blocks in a tier, pinned for a peer's read: P's KV
    server reads it as a transfer source's blocks (transfer/sources.py `TierRead`)."""

    tier: HostTier
    keys: dict[int, dict[int, BlockKey]]  # per group: its block's position -> its key (a window's: its tail)
    num_tokens: int  # the prompt tokens the run covers
    closed: bool = False

    def gather(self, layer: str, group: int, indices: Sequence[int]) -> torch.Tensor:
        """Blocks `indices` of the run in `layer`, [len(indices), *block_shape] in host memory
        (KeyError for a window group's block the run does not hold: before its window)."""
        missing = [i for i in indices if i not in self.keys[group]]
        if missing:
            raise KeyError(f"the pooled run holds group {group}'s blocks {min(self.keys[group], default=0)}-"
                           f"{max(self.keys[group], default=-1)}, not {missing[0]}")
        return self.tier._gather(layer, [self.keys[group][i] for i in indices])

    def close(self) -> None:
        """The read is over: unpin (a second close is a no-op)."""
        if not self.closed:
            self.closed = True
            for run in self.keys.values():
                self.tier._unpin(list(run.values()))
