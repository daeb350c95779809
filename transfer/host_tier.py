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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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

    def block_bytes(self, group: int) -> int:
        """One block of `group` in the tier, all its layers: what the book counts per block."""
        return self._group_bytes[group]

    @property
    def nbytes(self) -> int:
        return sum(self.block_bytes(group) for group, _ in self._blocks)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def store(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """Copy device blocks `block_ids` into the tier under `keys` (one group: the keys')."""
        group = self._one_group(keys, block_ids)
        copies: dict[BlockKey, dict[str, torch.Tensor]] = {k: {} for k in keys}
        for name in self._layers[group]:
            gathered = self._kv.gather(name, list(block_ids)).cpu()  # one read per layer for all the blocks
            for i, k in enumerate(keys):
                block = torch.empty_like(gathered[i], pin_memory=self._pin)
                copies[k][name] = block.copy_(gathered[i])  # each block its own storage: evicted alone
        self._blocks.update(copies)

    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """Copy the kept blocks `keys` into device blocks `block_ids` (KeyError naming one not kept:
        the book and the bytes out of step)."""
        group = self._one_group(keys, block_ids)
        missing = [k for k in keys if k not in self._blocks]
        if missing:
            raise KeyError(f"the host tier holds no bytes for {len(missing)} of the {len(keys)} blocks to load "
                           f"(first: group {missing[0][0]}, hash {missing[0][1].hex()[:16]})")
        for name in self._layers[group]:
            view = self._kv.view(name)
            data = torch.stack([self._blocks[k][name] for k in keys])
            view.index_copy_(0, torch.tensor(list(block_ids), dtype=torch.long, device=view.device),
                             data.to(view.device, non_blocking=self._pin))

    def evict(self, keys: Sequence[BlockKey]) -> None:
        for k in keys:
            self._blocks.pop(k, None)

    def _one_group(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks: one key per block")
        groups = {g for g, _ in keys}
        if len(groups) != 1 or not groups <= self._layers.keys():
            raise ValueError(f"blocks of KV-cache groups {sorted(groups)}: one call moves one group's, of "
                             f"{sorted(self._layers)}")
        return groups.pop()
