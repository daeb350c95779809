"""Paged KV blocks over a torch.distributed channel (transfer/dist_channel.py): a plan's blocks cut
into chunks both sides cut alike, posted a window at a time, straight into the blocks when they
are consecutive and through a buffer otherwise."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from pdcluster.transfer.dist_channel import Pending, TensorChannel


def chunk_runs(num_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(first, count) runs of at most chunk_blocks blocks: both sides cut a plan identically."""
    return [(f, min(chunk_blocks, num_blocks - f)) for f in range(0, num_blocks, chunk_blocks)]


def chunk_blocks_for(view: torch.Tensor, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (view[0].numel() * view.element_size()))


def count_chunks(layers: Sequence[tuple[torch.Tensor, Sequence[int]]], chunk_bytes: int) -> int:
    """How many tags a transfer of these (block-first view, block ids) layers uses."""
    return sum(len(chunk_runs(len(ids), chunk_blocks_for(v, chunk_bytes))) for v, ids in layers)


def _run_slice(ids: Sequence[int]) -> slice | None:
    first = ids[0]
    return slice(first, first + len(ids)) if all(b == first + i for i, b in enumerate(ids)) else None


def _chunks(layers, chunk_bytes):
    for view, ids in layers:
        ids = list(ids)
        for first, count in chunk_runs(len(ids), chunk_blocks_for(view, chunk_bytes)):
            yield view, ids[first:first + count]


def _pipelined(posts, window: int) -> None:
    inflight: deque[Pending] = deque()
    for post in posts:
        if len(inflight) >= window:
            inflight.popleft().wait()
        inflight.append(post())
    while inflight:
        inflight.popleft().wait()


def send_blocks(ch: TensorChannel, layers: Sequence[tuple[torch.Tensor, Sequence[int]]], first_tag: int,
                chunk_bytes: int, window: int = 8) -> None:
    """Send blocks of block-first views (vLLM's per-layer KV tensors, block dim first), chunk k under
    first_tag + k, at most `window` chunks in flight. A run of consecutive block ids in a
    contiguous view goes without a copy; other runs are gathered first. Gloo costs 0.2-0.5 ms
    a message on the 2-core test machine: 16 MiB chunks ran at raw-TCP speed, 1 MiB at half
    of it (bench/stream_throughput.py)."""
    _pipelined((_send_post(ch, v, ids, first_tag + k) for k, (v, ids) in enumerate(_chunks(layers, chunk_bytes))),
               window)


def _send_post(ch, view, ids, tag):
    def post():
        run = _run_slice(ids)
        if run is not None and view[run].is_contiguous():
            src = view[run]
        else:
            src = view.index_select(0, torch.tensor(ids, device=view.device))
        return ch.send_async(src, tag)
    return post


def _recv_post(ch, view, ids, tag):
    def post():
        run = _run_slice(ids)
        if run is not None and view[run].is_contiguous():
            return ch.recv_async(view[run], tag)  # straight into the cache
        tmp = torch.empty((len(ids), *view.shape[1:]), dtype=view.dtype, device=view.device)
        idx = torch.tensor(ids, device=view.device)
        return ch.recv_async(tmp, tag).then(lambda: view.index_copy_(0, idx, tmp), keep=tmp)
    return post


def recv_blocks(ch: TensorChannel, layers: Sequence[tuple[torch.Tensor, Sequence[int]]], first_tag: int,
                chunk_bytes: int, window: int = 8) -> None:
    """Receive what send_blocks sent into these blocks (same chunking, same tags)."""
    _pipelined((_recv_post(ch, v, ids, first_tag + k) for k, (v, ids) in enumerate(_chunks(layers, chunk_bytes))),
               window)
