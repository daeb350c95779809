"""Block-level reads and writes of one engine's paged KV cache.

vLLM hands the worker one tensor per attention layer (`register_kv_caches`).
Backends lay them out differently (CPU: [num_blocks, 2, ...]; flash-attn:
[2, num_blocks, ...]), so each layer is viewed with its block dimension first:
`view[b]` is block b of that layer, whatever the backend.

vLLM-Ascend's NPUModelRunner registers a tuple per layer instead: (k_cache, v_cache),
or with DeepSeek's sparse attention also its indexer keys and scales, each tensor
[num_blocks, ...] of its own shape and dtype. Each tuple element is then a part of its
own, named `layer[i]`, moved like a layer; `LayerInfo.source` names the vLLM layer
whose forward pass writes it (what P's source table tracks).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerInfo:
    name: str  # the vLLM layer's name, or 'layer[i]' for part i of a tuple-registered layer
    group: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    source: str = ""  # the vLLM layer it belongs to ("": itself)

    @property
    def vllm_layer(self) -> str:
        return self.source or self.name

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.dtype.itemsize


def _block_first(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    # The block dimension is the one of size num_blocks; dim 0 wins a tie
    # (CPU layout), then dim 1 (flash-attn's leading K/V dimension of size 2).
    for dim in (0, 1):
        if t.shape[dim] == num_blocks:
            return t.movedim(dim, 0)
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV tensor of shape {tuple(t.shape)}")


class PagedKv:
    """The layers of one engine's KV cache, addressed by (layer, block ids)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]], layer_groups: dict[str, int],
                 num_blocks: int):
        missing = set(kv_caches) - set(layer_groups)
        assert not missing, f"layers {sorted(missing)} are in no KV-cache group: kv_cache_config out of sync"
        self._views: dict[str, torch.Tensor] = {}
        self.layers: dict[str, LayerInfo] = {}
        for name, kv in kv_caches.items():
            parts = {name: kv} if isinstance(kv, torch.Tensor) else {f"{name}[{i}]": t for i, t in enumerate(kv)}
            for part, t in parts.items():
                view = self._views[part] = _block_first(t, num_blocks)
                self.layers[part] = LayerInfo(part, layer_groups[name], tuple(view.shape[1:]), view.dtype,
                                              source="" if part == name else name)

    def view(self, layer: str) -> torch.Tensor:
        """The layer's cache, block dimension first (shares its storage)."""
        return self._views[layer]

    def gather(self, layer: str, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of these blocks, [len(block_ids), *block_shape]: valid after the blocks are reused."""
        view = self._views[layer]  # (the index on the cache's device: a CUDA tensor takes no CPU index)
        return view.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=view.device)).contiguous()

    def byte_runs(self, layer: str, block_ids: Sequence[int]) -> list[memoryview] | None:
        """The blocks' bytes in place, one view per run of consecutive block ids, in order; None
        where a block run is not one contiguous span of host memory (flash-attn's [2, num_blocks, ...];
        a device's cache).
        The views share the cache: read them before the blocks can be reused."""
        view = self._views[layer]
        if view.device.type != "cpu":
            return None
        out = []
        for first, count in block_runs(block_ids):
            run = view[first:first + count]
            if not run.is_contiguous():
                return None
            out.append(memoryview(run.reshape(-1).view(torch.uint8).numpy()))
        return out

    def gather_to_host(self, layer: str, block_ids: Sequence[int]) -> torch.Tensor:
        """`gather`, in host memory (a device's cache: one copy more, to the host)."""
        return self.gather(layer, block_ids).cpu()

    def read(self, layer: str, block_ids: Sequence[int]) -> bytes:
        return self.gather_to_host(layer, block_ids).view(torch.uint8).numpy().tobytes()

    def write(self, layer: str, block_ids: Sequence[int], data: bytes | memoryview) -> None:
        """Copy `data` (the blocks in order, as `byte_runs`/`read` lay them out) into these blocks:
        one slice copy per run of consecutive ids (half the cost of an indexed write; from host to
        a device's cache too), or an indexed write where a run is not contiguous."""
        info = self.layers[layer]
        expected = len(block_ids) * info.block_bytes
        if len(data) != expected:
            raise ValueError(f"layer {layer}: got {len(data)} bytes for {len(block_ids)} blocks, expected {expected}")
        with warnings.catch_warnings():
            # `data` is read-only and only read from: the copy into the cache is the one copy.
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        src = src.view(info.dtype).view(len(block_ids), *info.block_shape)
        view = self._views[layer]
        runs = block_runs(block_ids)
        if all(view[first:first + count].is_contiguous() for first, count in runs):
            at = 0
            for first, count in runs:
                view[first:first + count].copy_(src[at:at + count])
                at += count
        else:
            view[torch.tensor(block_ids, dtype=torch.long, device=view.device)] = src.to(view.device)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, count) of each maximal run of consecutive ids, in order: [3, 4, 5, 9] -> [(3, 3), (9, 1)]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
