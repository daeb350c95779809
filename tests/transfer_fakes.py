"""P and D ends of the KV transfer for unit tests, over real gRPC on 127.0.0.1 with real torch KV
tensors (tests/test_grpc_transfer.py, tests/test_dist_transfer.py).

P: KvServer over source tensors + a SourceTable. D: KvFetcher over zeroed destination
tensors. No vLLM, no Ray. `offer` plays P's connector: a finished prefill (every layer ready)
or, step by step, a running one (push). The fixtures (`make_p`, `make_d`, `stub_to`,
`gloo_pair`) are imported by tests/conftest.py.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import grpc
import pytest
import torch
from e2e import wait_until

from pdcluster.proto.handle import TransferHandle
from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2_grpc as pb_grpc
from pdcluster.transfer.grpc_auth import GrpcAuth, grpc_authenticated_channel
from pdcluster.transfer.grpc_client import KvFetcher, LoadJob, LoadResults
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.plan import GroupPlan, TransferPlan
from pdcluster.transfer.sources import SourceTable

SECRET = "grpc-transfer-test-secret-01"

P_BLOCKS = 12  # P's and D's caches differ in size; only the block layout must match
D_BLOCKS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
GROUPS = dict.fromkeys(LAYERS, 0)
SOURCE_WAIT_S = 0.3  # P's wait for a transfer it has not heard of, when D sets no deadline
TIMEOUT_S = 2.0  # D's per-RPC timeout
BLOCK_SIZE = 16


# ---------------------------------------------------------------- layouts and tensors


def cpu_shape(num_blocks, block_shape=(2, 16, 32)):  # vLLM CPU backend: block dim first
    return (num_blocks, *block_shape)


def flash_shape(num_blocks):  # flash-attn: [2 (K/V), num_blocks, ...]
    return (2, num_blocks, 8, 4)


LAYOUTS = {"cpu": (cpu_shape, 0), "flash": (flash_shape, 1)}  # shape fn, block dim


def source_caches(shape, seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One tensor per layer, all values distinct (and non-zero) across layers."""
    numel = torch.Size(shape).numel()
    g = torch.Generator().manual_seed(seed)
    values = (torch.randperm(numel * len(LAYERS), generator=g) + 1).to(dtype)
    return {name: values[i * numel:(i + 1) * numel].view(shape).clone() for i, name in enumerate(LAYERS)}


def zero_caches(shape, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=dtype) for name in LAYERS}


def block(t: torch.Tensor, block_dim: int, b: int) -> torch.Tensor:
    return t.select(block_dim, b)


def assert_zero_except(caches, block_dim, num_blocks, written=()):
    for name, t in caches.items():
        for b in set(range(num_blocks)) - set(written):
            assert not block(t, block_dim, b).any(), f"{name}: block {b} was written"


# ---------------------------------------------------------------- factories


def make_plan(remote, local, d_cached_tokens=0) -> TransferPlan:
    """remote: indices into P's block table."""
    return TransferPlan((GroupPlan(0, "full_attention", tuple(remote), tuple(local)),),
                        d_cached_tokens=d_cached_tokens, transferred_tokens=len(remote) * BLOCK_SIZE)


def make_handle(address, transfer_id="r1", num_blocks=4) -> TransferHandle:
    return TransferHandle(engine_id="p0", address=address, transfer_id=transfer_id,
                          num_tokens=num_blocks * BLOCK_SIZE)


def make_job(address, remote, local, transfer_id="r1", d_request_id=None, num_blocks=4,
             transport="grpc") -> LoadJob:
    handle = TransferHandle("p0", address, transfer_id, num_blocks * BLOCK_SIZE, transport)
    return LoadJob(d_request_id or f"d-{transfer_id}", handle, make_plan(remote, local))


def offer(p, transfer_id, block_ids, lease_s=60.0, ready_tokens=None):
    """P's connector for one prefill in block_ids: every layer ready up to ready_tokens
    (default: the whole prompt, then finished under a lease). P's request id == transfer id."""
    num_tokens = len(block_ids) * BLOCK_SIZE
    p.sources.step(transfer_id, transfer_id, num_tokens, (tuple(block_ids),),
                   num_tokens if ready_tokens is None else ready_tokens)
    p.sources.step_done()
    if ready_tokens is None:
        p.sources.finish(transfer_id, lease_s)


def released(sources, want: set[str], timeout=5.0) -> set[str]:
    """P's released transfers once `want` are among them (or at the deadline), then one more look:
    after a failed load D releases after it reports, so the release may come a moment later."""
    got: set[str] = set()
    deadline = time.monotonic() + timeout
    while not want <= got and time.monotonic() < deadline:
        got |= sources.take_finished()
        time.sleep(0.02)
    return got | sources.take_finished()


def wait_results(fetcher: KvFetcher, ids, timeout=TIMEOUT_S + 1.0) -> LoadResults:
    """Accumulate take_results() until all of ids finished, or the deadline."""
    acc = LoadResults()
    deadline = time.monotonic() + timeout
    while True:
        r = fetcher.take_results()
        acc.finished |= r.finished
        acc.failed |= r.failed
        acc.timings |= r.timings
        if set(ids) <= acc.finished or time.monotonic() > deadline:
            return acc
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- fixtures


@dataclass
class P:
    caches: dict[str, torch.Tensor]
    kv: PagedKv
    sources: SourceTable
    server: KvServer
    block_dim: int


@dataclass
class D:
    caches: dict[str, torch.Tensor]
    kv: PagedKv
    fetcher: KvFetcher
    block_dim: int


@pytest.fixture
def make_p():
    servers = []

    def make(layout="cpu", chunk_bytes=1 << 20, require_seal=False) -> P:
        shape_fn, block_dim = LAYOUTS[layout]
        caches = source_caches(shape_fn(P_BLOCKS))
        kv = PagedKv(caches, GROUPS, P_BLOCKS)
        sources = SourceTable(GROUPS, (BLOCK_SIZE,))
        server = KvServer("p0", kv, sources, "127.0.0.1", 0, chunk_bytes, secret=SECRET, wait_s=SOURCE_WAIT_S,
                          require_seal=require_seal)
        servers.append(server)
        return P(caches, kv, sources, server, block_dim)

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def make_d():
    fetchers = []

    def make(layout="cpu", caches=None, timeout_s=TIMEOUT_S, max_workers=4, seal=False) -> D:
        shape_fn, block_dim = LAYOUTS[layout]
        caches = caches if caches is not None else zero_caches(shape_fn(D_BLOCKS))
        kv = PagedKv(caches, GROUPS, D_BLOCKS)
        fetcher = KvFetcher("d0", kv, timeout_s, max_workers=max_workers, secret=SECRET, seal=seal)
        fetchers.append(fetcher)
        return D(caches, kv, fetcher, block_dim)

    yield make
    for f in fetchers:
        f.stop()


@pytest.fixture
def stub_to():
    channels = []

    def make(address, secret: str | None = SECRET, server: str = "p0") -> pb_grpc.KvTransferStub:
        ch = grpc.insecure_channel(address)
        channels.append(ch)
        # as D calls P `server` (ReadBlocks yields Frames), proving the cluster secret (None: not)
        return frames.framed_stub(ch if secret is None else grpc_authenticated_channel(ch, GrpcAuth(secret), server))

    yield make
    for ch in channels:
        ch.close()


def wait_until_true(cond, timeout: float = 3.0):
    """e2e.wait_until at a transfer test's pace (a few ms between looks)."""
    return wait_until(cond, timeout, interval=0.005)


@pytest.fixture
def gloo_pair(make_d):
    """P's server with gloo data channels, D's fetcher using them (both in this process)."""
    made = []

    def make(layout="cpu", chunk_bytes=1 << 20, break_prefix=None):
        shape_fn, block_dim = LAYOUTS[layout]
        caches = source_caches(shape_fn(P_BLOCKS))
        kv = PagedKv(caches, GROUPS, P_BLOCKS)
        sources = SourceTable(GROUPS, (BLOCK_SIZE,))
        server = KvServer("p0", kv, sources, "127.0.0.1", 0, chunk_bytes, secret=SECRET, wait_s=5.0,
                          break_prefix=break_prefix, channel_backend="gloo")
        dst = zero_caches(shape_fn(D_BLOCKS))
        d_kv = PagedKv(dst, GROUPS, D_BLOCKS)
        fetcher = KvFetcher("d0", d_kv, timeout_s=10.0, secret=SECRET)
        made.append((server, fetcher))
        return P(caches, kv, sources, server, block_dim), D(dst, d_kv, fetcher, block_dim)

    yield make
    for server, fetcher in made:
        fetcher.stop()
        server.stop()
