"""The bytes a simulated engine's KV state really holds, and how D checks what it got.

Each state component of the cost model (cluster/sim/cost.py: full, window,
compressed, state) is one "layer" of a `PagedKv` (transfer/paged_kv.py) and one
KV-cache group of the transfer, indexed by the instance's block ids: a block row
is `ceil(bytes_per_block / payload_scale)` bytes, so the transfer moves the
modelled state scaled down by `payload_scale`, through the project's real
KvServer / KvFetcher.

Rows are `torch.empty`: the kernel commits a page only when it is written, so a
window or state component (only a request's tail blocks are ever written)
costs the memory of those rows, not of the whole table.

Content: every row of a block is its *key* (8 bytes: the block's vLLM hash, for
a partial last block a hash of its parent and tokens, mixed with the
component's index) repeated. P writes rows as its steps compute them; D
recomputes the keys from the same prompt and checks the first bytes of every
row it received, so a block that went to the wrong place, or never came, is
caught.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch

from pdcluster.cluster.sim.cost import Component
from pdcluster.transfer.paged_kv import PagedKv

_MIX = 0x9E3779B97F4A7C15


def component_rows_bytes(c: Component, payload_scale: int) -> int:
    return max(1, math.ceil(c.bytes_per_block / payload_scale))


def make_paged_kv(components: Sequence[Component], num_blocks: int, payload_scale: int,
                  kv_class: type[PagedKv] = PagedKv) -> PagedKv:
    """One uint8 tensor per component, [num_blocks, row bytes]; component i is group i."""
    tensors = {c.name: torch.empty((num_blocks, component_rows_bytes(c, payload_scale)), dtype=torch.uint8)
               for c in components}
    return kv_class(tensors, {c.name: i for i, c in enumerate(components)}, num_blocks)


def block_keys(block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int) -> np.ndarray:
    """uint64 key of each block of a prompt (its last, partial block included)."""
    n = -(-len(token_ids) // block_size)
    keys = np.empty(n, dtype=np.uint64)
    for i, h in enumerate(block_hashes[:n]):
        keys[i] = int.from_bytes(h[:8], "little")
    if len(block_hashes) < n:  # the partial last block: its parent and its own tokens
        tail = np.asarray(token_ids[(n - 1) * block_size:], dtype=np.int64).tobytes()
        parent = block_hashes[n - 2] if n >= 2 else b""
        keys[n - 1] = int.from_bytes(hashlib.sha256(parent + tail).digest()[:8], "little")
    return keys


def rows(keys: np.ndarray, component_index: int, width: int) -> torch.Tensor:
    """The rows of these blocks (keys[i] for block i) of one component, [len(keys), width] bytes."""
    mixed = keys + np.uint64((component_index + 1) * _MIX & ((1 << 64) - 1))
    as_bytes = mixed.astype("<u8").view(np.uint8).reshape(len(keys), 8)
    return torch.from_numpy(np.tile(as_bytes, (1, -(-width // 8)))[:, :width].copy())


def fill(kv: PagedKv, component_index: int, name: str, block_ids: Sequence[int], keys: np.ndarray) -> None:
    """P: write these blocks' rows of one component (keys[i] for block_ids[i])."""
    if not len(block_ids):
        return
    view = kv.view(name)
    view[torch.tensor(block_ids, dtype=torch.long)] = rows(keys, component_index, view.shape[1])


def mismatched(kv: PagedKv, component_index: int, name: str, block_ids: Sequence[int],
               keys: np.ndarray) -> list[int]:
    """D: the block ids whose row does not start with its expected key (empty: all good)."""
    if not len(block_ids):
        return []
    view = kv.view(name)
    width = min(8, view.shape[1])
    got = view[torch.tensor(block_ids, dtype=torch.long), :width]
    want = rows(keys, component_index, width)
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    return [block_ids[i] for i in bad]
