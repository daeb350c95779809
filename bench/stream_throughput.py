"""State-streaming throughput: one 128K-token request's KV blocks, P process -> D process, loopback.

The tiny Qwen3's KV cache (cluster/tiny_model.py's shape: layers, KV heads, head dim),
block 128, bfloat16, vLLM's CPU layout (one tensor per layer, block dim first), moved
from a P process into a D process's cache in the same run by:

  raw-tcp   one socket, sendall of each layer's blocks / recv_into D's cache: the reference;
  grpc      the project's gRPC transport as it is (KvServer serving the request's blocks,
            KvFetcher pulling a plan into D's PagedKv), at 1 MiB and 4 MiB chunks;
  gloo      transfer/dist_channel.py: per-layer chunks sent from P's blocks straight into
            D's destination blocks (send_blocks/recv_blocks); also with shuffled block ids,
            where chunks are gathered on P and scattered on D.

Trials are interleaved across methods (trial 1 of each, then trial 2 of each, ...) so
background load hits them alike; each figure is the median of --trials, each ratio is to
raw TCP's median of the same run. D (this process) times each transfer from asking to the
last byte in its cache. P is pinned to core 0 and D to core 1 (as the cluster binds them),
unless --no-pin. --profile adds where the gRPC path's time goes (see profile()).

usage: python -m pdcluster.bench.stream_throughput [--tokens 131072] [--trials 7] [--profile]
(bench/stream_veth.py runs P and D on two hosts of the multi-host lab instead, across the veth.)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time

import torch

from pdcluster.bench.stream_common import (
    BENCH_SECRET,
    DTYPE,
    HOST,
    MALLOC_TUNED,
    MIB,
    Shape,
    _exit_now,
    block_ids,
    caches,
    grpc_job,
    grpc_source_table,
    in_threads,
    pin,
    split,
    stripes,
    tiny_shape,
)


def _p_main(shape: Shape, grpc_chunks: list[int], jobs: int, core: int | None, ready, host: str = HOST,
            secret: str = BENCH_SECRET, streams: int = 1) -> None:
    """P: KV services (one per chunk size) over shape's blocks, a gloo channel, raw TCP sockets on
    `host`; their addresses go to ready.put(); then it serves D's commands until "quit"."""
    from pdcluster.transfer.dist_blocks import send_blocks
    from pdcluster.transfer.grpc_server import KvServer
    from pdcluster.transfer.paged_kv import PagedKv
    from pdcluster.transfer.sources import SourceTable

    pin(core)
    src = caches(shape, fill=True)
    groups = dict.fromkeys(src, 0)
    kv = PagedKv(src, groups, shape.num_blocks + 1)
    ids = block_ids(shape, False, 0)
    servers = {c: KvServer("bench-P", kv, grpc_source_table(groups, ids, jobs), host, 0, c, secret=secret,
                           channel_backend="gloo", channel_chunk_bytes=c)
               for c in grpc_chunks}
    # The gloo channel alone: opened by D through a KV service of its own, as transfers open theirs.
    chan_server = KvServer("bench-P-channel", PagedKv({}, {}, 0), SourceTable({}, ()), host, 0, MIB, secret=secret,
                           channel_backend="gloo")
    data = socket.create_server((host, 0))
    ctrl = socket.create_server((host, 0))
    ready.put({"grpc": {c: s.address for c, s in servers.items()}, "data": data.getsockname()[1],
               "ctrl": ctrl.getsockname()[1], "channel": chan_server.address})
    channels = chan_server._channels
    deadline = time.monotonic() + 120
    while not channels.opened():
        if time.monotonic() > deadline:
            raise TimeoutError("D opened no gloo channel in 120 s")
        time.sleep(0.01)
    ch = channels.get(channels.opened()[0])
    # 1 + streams data connections: kernel-default buffers, and `streams` with the send buffer gloo
    # asks for on its sockets (min(message, 32 MiB), which the kernel caps at net.core.wmem_max).
    dconns = [data.accept()[0] for _ in range(1 + streams)]
    for c in dconns[1:]:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * MIB)
    cconn, _ = ctrl.accept()
    # Raw TCP sends each layer's request blocks as they lie in P's cache (blocks 1..n: one run).
    regions = [memoryview(t[1:].view(torch.uint8).numpy()).cast("B") for t in src.values()]
    with cconn.makefile("r") as commands:
        for line in commands:
            cmd, *args = line.split()
            if cmd == "raw":  # raw FIRST N: over data connections FIRST..FIRST+N-1, one stripe each
                first, n = int(args[0]), int(args[1])
                in_threads(lambda job: [job[0].sendall(r) for r in job[1]],
                           list(zip(dconns[first:first + n], stripes(regions, n), strict=True)))
            elif cmd == "gloo":
                first_tag, chunk, shuffled = int(args[0]), int(args[1]), args[2] == "1"
                p_ids = block_ids(shape, shuffled, seed=1)
                send_blocks(ch, [(t, p_ids) for t in src.values()], first_tag, chunk)
            elif cmd == "quit":
                break
    ch.close()
    for s in [*servers.values(), chan_server]:
        s.stop()
    _exit_now()


# ---------------------------------------------------------------- D (this process) and the trials


def sources_needed(trials: int, streams: int) -> int:
    """Sources each of P's KV services holds: a pull of N streams takes N (one per part), and each
    service serves a gRPC and a torch_dist method per stream count, checked once, then trials times."""
    return 4 * (trials + 1) * streams


class Bench:
    """D, in this process. `p`: P's addresses (what _p_main put), for a P already running on `host`
    (bench/stream_veth.py); else P is spawned here on loopback."""

    def __init__(self, shape: Shape, grpc_chunks: list[int], trials: int, pin_cores: bool, host: str = HOST,
                 p: dict | None = None, streams: int = 1, secret: str = BENCH_SECRET):
        from pdcluster.transfer.channels import ChannelPool
        from pdcluster.transfer.dist_liveness import channel_liveness_key
        from pdcluster.transfer.grpc_auth import GrpcAuth
        from pdcluster.transfer.grpc_client import KvFetcher, kv_stub
        from pdcluster.transfer.paged_kv import PagedKv

        self.shape, self.proc = shape, None
        if p is None:
            ctx = mp.get_context("spawn")
            ready = ctx.Queue()
            self.proc = ctx.Process(target=_p_main, daemon=True, args=(
                shape, grpc_chunks, sources_needed(trials, streams), 0 if pin_cores else None, ready, HOST, secret,
                streams))
            self.proc.start()
            p = ready.get(timeout=120)
        pin(1 if pin_cores else None)
        self.dst = caches(shape, fill=False)
        self.kv = PagedKv(self.dst, dict.fromkeys(self.dst, 0), shape.num_blocks + 1)
        self.fetcher = KvFetcher("bench-D", self.kv, timeout_s=120, secret=secret)
        self.sealed_fetcher = KvFetcher("bench-D", self.kv, timeout_s=120, secret=secret, seal=True)
        self.grpc = {int(c): a for c, a in p["grpc"].items()}
        self.pool = ChannelPool("bench-D", 120, channel_liveness_key(secret))
        self.ch = self.pool.get(p["channel"], kv_stub(p["channel"], GrpcAuth(secret), "bench-P-channel")[1])
        self.data = [socket.create_connection((host, p["data"])) for _ in range(1 + streams)]
        self.ctrl = socket.create_connection((host, p["ctrl"]))
        self.regions = [memoryview(t[1:].view(torch.uint8).numpy()).cast("B") for t in self.dst.values()]
        self.grpc_trial = dict.fromkeys(grpc_chunks, 0)

    def _command(self, line: str) -> None:
        self.ctrl.sendall((line + "\n").encode())

    def raw_tcp(self, big_sndbuf: bool, streams: int = 1) -> float:
        """Over one connection (kernel-default buffers, or gloo's send buffer), or `streams` at once."""
        first = int(big_sndbuf or streams > 1)

        def recv(job) -> None:
            conn, views = job
            for r in views:
                view, left = r, len(r)
                while left:
                    got = conn.recv_into(view, left)
                    if not got:
                        raise ConnectionError("P closed the data socket")
                    view, left = view[got:], left - got

        t0 = time.perf_counter()
        self._command(f"raw {first} {streams}")
        in_threads(recv, list(zip(self.data[first:first + streams], stripes(self.regions, streams), strict=True)))
        return time.perf_counter() - t0

    def grpc_pull(self, chunk: int, transport: str = "grpc", streams: int = 1, sealed: bool = False) -> float:
        """One pull of every block, or `streams` pulls of a part each at once (the fetcher's threads);
        `sealed`: the bytes sealed on the stream (transfer.encrypt)."""
        fetcher = self.sealed_fetcher if sealed else self.fetcher
        ids = block_ids(self.shape, False, 0)
        jobs = []
        for start, count in split(len(ids), streams):
            t = self.grpc_trial[chunk]
            self.grpc_trial[chunk] += 1
            jobs.append(grpc_job(self.grpc[chunk], t, len(ids), ids[start:start + count], transport, start))
        waiting, failed = {j.request_id for j in jobs}, set()
        t0 = time.perf_counter()
        for job in jobs:
            fetcher.submit(job)
        while waiting:
            res = fetcher.take_results()
            waiting -= res.finished
            failed |= res.failed
            if waiting:
                time.sleep(0.0002)
        elapsed = time.perf_counter() - t0
        assert not failed, f"gRPC pulls {sorted(failed)} at {chunk} B chunks ({transport}) failed"
        return elapsed

    def gloo(self, chunk: int, shuffled: bool = False) -> float:
        from pdcluster.transfer.dist_blocks import count_chunks, recv_blocks

        d_ids = block_ids(self.shape, shuffled, seed=2)
        layers = [(t, d_ids) for t in self.dst.values()]
        first = self.ch.allocate_tags(count_chunks(layers, chunk))
        t0 = time.perf_counter()
        self._command(f"gloo {first} {chunk} {int(shuffled)}")
        recv_blocks(self.ch, layers, first, chunk)
        return time.perf_counter() - t0

    def check(self, method, *args, shuffled: bool = False) -> None:
        """Run once untimed into a zeroed cache and compare every block with P's (same seeds)."""
        for t in self.dst.values():
            t.zero_()
        method(*args)
        src = caches(self.shape, fill=True)
        p_ids = block_ids(self.shape, shuffled, seed=1) if shuffled else block_ids(self.shape, False, 0)
        d_ids = block_ids(self.shape, shuffled, seed=2) if shuffled else p_ids
        for name, t in self.dst.items():
            same = torch.equal(t[d_ids].view(torch.int16), src[name][p_ids].view(torch.int16))
            assert same, f"{method.__name__}{args}: {name} differs from P's blocks"

    def close(self) -> None:
        self.fetcher.stop()
        self.sealed_fetcher.stop()
        self._command("quit")
        if self.proc is not None:
            self.proc.join(timeout=30)
        self.pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--grpc-chunk-mib", default="1,4")
    ap.add_argument("--gloo-chunk-mib", default="1,4,16,64")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also break down the gRPC path's time")
    a = ap.parse_args()

    shape = tiny_shape(a.tokens)
    grpc_chunks = [int(float(x) * MIB) for x in a.grpc_chunk_mib.split(",")]
    gloo_chunks = [int(float(x) * MIB) for x in a.gloo_chunk_mib.split(",")]
    print(f"{a.tokens} tokens of the tiny Qwen3: {shape.layers} layers x {shape.num_blocks} blocks of "
          f"{shape.block_shape} {str(DTYPE).removeprefix('torch.')} = {shape.total_bytes:,} bytes "
          f"({shape.total_bytes / MIB:.0f} MiB); {a.trials} trials, {os.cpu_count()} cores, "
          f"{'pinned P core 0 / D core 1' if not a.no_pin else 'unpinned'}", flush=True)
    if tuned := {k: os.environ[k] for k in MALLOC_TUNED if k in os.environ}:
        print(f"malloc: {' '.join(f'{k}={v}' for k, v in tuned.items())}", flush=True)

    b = Bench(shape, grpc_chunks, a.trials, not a.no_pin)
    methods = [("raw TCP, gloo's send buffer (the reference)", b.raw_tcp, (True,)),
               ("raw TCP, kernel-default buffers", b.raw_tcp, (False,))]
    methods += [(f"gRPC KvServer/KvFetcher, {c // MIB} MiB chunks", b.grpc_pull, (c,)) for c in grpc_chunks]
    methods += [(f"gRPC sealed (transfer.encrypt), {c // MIB} MiB chunks", b.grpc_pull, (c, "grpc", 1, True))
                for c in grpc_chunks]
    methods += [(f"KvServer/KvFetcher, torch_dist (gloo), {c // MIB} MiB chunks", b.grpc_pull, (c, "torch_dist"))
                for c in grpc_chunks]
    methods += [(f"gloo channel, {c // MIB} MiB chunks", b.gloo, (c,)) for c in gloo_chunks]
    shuffled_chunk = min(gloo_chunks, key=lambda c: abs(c - 4 * MIB))
    methods += [(f"gloo channel, {shuffled_chunk // MIB} MiB chunks, shuffled ids",
                 lambda c: b.gloo(c, shuffled=True), (shuffled_chunk,))]
    try:
        for label, fn, args in methods:
            b.check(fn, *args, shuffled="shuffled" in label)
        times: dict[str, list[float]] = {label: [] for label, _, _ in methods}
        for _ in range(a.trials):
            for label, fn, args in methods:
                times[label].append(fn(*args))
    finally:
        b.close()

    ref = statistics.median(times[methods[0][0]])
    print(f"\n{'method':<48} {'median ms':>9} {'GB/s':>6} {'vs raw TCP':>10}  (min-max GB/s)")
    for label, ts in times.items():
        med = statistics.median(ts)
        gbs = shape.total_bytes / med / 1e9
        spread = f"{shape.total_bytes / max(ts) / 1e9:.2f}-{shape.total_bytes / min(ts) / 1e9:.2f}"
        print(f"{label:<48} {med * 1e3:>9.1f} {gbs:>6.2f} {ref / med:>9.0%}  ({spread})")
    print("goal (issue): >= 60% of raw TCP")
    if a.profile:
        from pdcluster.bench.stream_profile import profile

        profile(shape, sorted({*grpc_chunks, 16 * MIB}), a.trials, not a.no_pin, ref * 1e3)


if __name__ == "__main__":
    main()
