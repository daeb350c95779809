"""What bench/stream_throughput.py's P and D ends share (and stream_veth.py, stream_profile.py): the
request's shape (the tiny Qwen3's KV, 128-token blocks, bf16), its caches and block ids, the
gRPC sources and jobs, striping, pinning."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

BLOCK_SIZE = 128
DTYPE = torch.bfloat16
HOST = "127.0.0.1"
MIB = 1 << 20
# P's KV service admits only callers with the cluster secret (transfer/auth.py): the env's, else this
BENCH_SECRET = os.environ.get("PDC_CLUSTER_SECRET") or "stream-bench-secret-0123456789"
# --profile: glibc malloc that keeps chunk-sized buffers (see stream_profile.py)
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 * MIB), "MALLOC_TRIM_THRESHOLD_": str(256 * MIB)}


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    num_blocks: int  # the request's blocks (P's and D's caches hold one more: block 0, vLLM's null block)

    @property
    def block_shape(self) -> tuple[int, ...]:  # vLLM CPU: [num_blocks, 2 (K/V), kv heads, block size, head dim]
        return (2, self.kv_heads, BLOCK_SIZE, self.head_dim)

    @property
    def block_bytes(self) -> int:  # one layer's block
        return 2 * self.kv_heads * BLOCK_SIZE * self.head_dim * DTYPE.itemsize

    @property
    def total_bytes(self) -> int:
        return self.layers * self.num_blocks * self.block_bytes

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]


def tiny_shape(tokens: int) -> Shape:
    from pdcluster.cluster.tiny_model import TinyShape

    s = TinyShape()
    return Shape(s.num_hidden_layers, s.num_key_value_heads, s.head_dim, -(-tokens // BLOCK_SIZE))


def caches(shape: Shape, fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i, name in enumerate(shape.layer_names()):
        if fill:
            g = torch.Generator().manual_seed(1000 + i)
            out[name] = torch.randn(shape.num_blocks + 1, *shape.block_shape, generator=g).to(DTYPE)
        else:
            out[name] = torch.zeros(shape.num_blocks + 1, *shape.block_shape, dtype=DTYPE)
    return out


def block_ids(shape: Shape, shuffled: bool, seed: int) -> list[int]:
    """The request's blocks in token order: 1..n, or a fixed permutation of them."""
    ids = list(range(1, shape.num_blocks + 1))
    if shuffled:
        perm = torch.randperm(shape.num_blocks, generator=torch.Generator().manual_seed(seed))
        ids = [ids[i] for i in perm.tolist()]
    return ids


def _exit_now() -> None:
    """End a child that served gRPC without the interpreter's teardown: gRPC's daemon serving thread
    holds the last reference to the handlers (and through them the KV tensors); freeing a tensor from
    a daemon thread while the interpreter finalizes aborts the process (std::terminate)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pin(core: int | None) -> None:
    torch.set_num_threads(1)
    if core is not None and hasattr(os, "sched_setaffinity") and os.cpu_count() and core < os.cpu_count():
        os.sched_setaffinity(0, {core})


# ---------------------------------------------------------------- the gRPC transport, without engines


def grpc_source_table(kv_layers: dict[str, int], ids: list[int], count: int):
    """P's sources r0..r{count-1}: finished prefills over the same blocks (a released one is gone)."""
    from pdcluster.transfer.sources import SourceTable

    table = SourceTable(kv_layers, (BLOCK_SIZE,))
    tokens = len(ids) * BLOCK_SIZE
    for t in range(count):
        table.step(f"r{t}", f"r{t}", tokens, (tuple(ids),), tokens)
        table.step_done()
        table.finish(f"r{t}", lease_s=3600)
    return table


def grpc_job(address: str, t: int, num_blocks: int, d_ids: list[int], transport: str = "grpc", first: int = 0):
    """D's load of source r{t} (num_blocks blocks): P's blocks first.. (every one by default), into d_ids."""
    from pdcluster.proto.handle import TransferHandle
    from pdcluster.transfer.grpc_client import LoadJob
    from pdcluster.transfer.plan import GroupPlan, TransferPlan

    tokens = num_blocks * BLOCK_SIZE
    remote = tuple(range(first, first + len(d_ids)))
    plan = TransferPlan((GroupPlan(0, "full_attention", remote, tuple(d_ids)),), 0, tokens)
    return LoadJob(f"d{t}", TransferHandle("bench-P", address, f"r{t}", tokens, transport), plan)


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """n items in `parts` consecutive (start, count) runs, as even as can be (none empty)."""
    parts = max(1, min(parts, n))
    return [(k * n // parts, (k + 1) * n // parts - k * n // parts) for k in range(parts)]


def stripes(regions: list[memoryview], parts: int) -> list[list[memoryview]]:
    """Each region cut in `parts` runs; stream k moves run k of every region (parallel raw TCP)."""
    out = [[] for _ in range(max(1, parts))]
    for r in regions:
        for k, (start, count) in enumerate(split(len(r), parts)):
            out[k].append(r[start:start + count])
    return out


def in_threads(fn, items: list) -> None:
    """fn(item) for each item, each in its own thread (one: in this one); re-raises the first failure."""
    if len(items) == 1:
        fn(items[0])
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(items)) as pool:
        for f in [pool.submit(fn, x) for x in items]:
            f.result()


# ---------------------------------------------------------------- P
