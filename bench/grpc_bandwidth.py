"""Raw bandwidth of the gRPC KV transport, without engines.

P's KvServer serves blocks of real torch tensors laid out as vLLM's CPU backend
lays them out; D's KvFetcher pulls a plan of N blocks into other tensors, in a
separate process, so the loopback transfer is real. Compare with NIXL's raw
read on this machine (../shared/probes/nixl: 5.5-7 GB/s).

usage: python -m pdcluster.bench.grpc_bandwidth [--mb 16,64,256] [--chunk-mb 4] [--trials 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from pdcluster.bench.stream_common import BENCH_SECRET

LAYERS = 2
BLOCK_SHAPE = (2, 128, 128)  # the tiny Qwen3's block, float32: 128 KiB a layer


def _tensors(num_blocks: int, fill: bool):
    import torch

    make = torch.randn if fill else torch.zeros
    return {f"layer.{i}": make(num_blocks, *BLOCK_SHAPE) for i in range(LAYERS)}


def _serve(num_blocks: int, chunk_bytes: int, lease_ids: list[int], ready, stop) -> None:
    from pdcluster.transfer.grpc_server import KvServer
    from pdcluster.transfer.paged_kv import PagedKv
    from pdcluster.transfer.sources import SourceTable

    layers = {f"layer.{i}": 0 for i in range(LAYERS)}
    kv = PagedKv(_tensors(num_blocks, fill=True), layers, num_blocks)
    sources = SourceTable(layers, (BLOCK_SHAPE[1],))
    server = KvServer("bench-P", kv, sources, "127.0.0.1", 0, chunk_bytes, secret=BENCH_SECRET)
    ready.put((server.address, sources_adder(sources, lease_ids)))
    stop.wait()
    server.stop()


def sources_adder(sources, ids):
    # Many finished prefills over the same blocks: one per trial (a released source cannot be read again).
    for t in range(64):
        sources.step(f"r{t}", f"r{t}", len(ids) * BLOCK_SHAPE[1], (tuple(ids),), len(ids) * BLOCK_SHAPE[1])
        sources.step_done()
        sources.finish(f"r{t}", lease_s=3600)
    return len(ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="16,64,256", help="payload sizes, MB")
    ap.add_argument("--chunk-mb", type=float, default=4)
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args()

    from pdcluster.proto.handle import TransferHandle
    from pdcluster.transfer.grpc_client import KvFetcher, LoadJob
    from pdcluster.transfer.paged_kv import PagedKv
    from pdcluster.transfer.plan import GroupPlan, TransferPlan

    block_bytes = 4 * BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * BLOCK_SHAPE[2] * LAYERS
    print(f"{'MB':>6} {'blocks':>7} {'median s':>9} {'GB/s':>6}")
    ctx = mp.get_context("spawn")
    for mb in (float(x) for x in a.mb.split(",")):
        n = max(1, int(mb * 1e6 // block_bytes))
        ready, stop = ctx.Queue(), ctx.Event()
        # Block 0 is vLLM's null block, never served: P's blocks are 1..n.
        proc = ctx.Process(target=_serve, args=(n + 1, int(a.chunk_mb * 2**20), list(range(1, n + 1)), ready, stop))
        proc.start()
        address, _ = ready.get(timeout=60)
        kv = PagedKv(_tensors(n, fill=False), {f"layer.{i}": 0 for i in range(LAYERS)}, n)
        fetcher = KvFetcher("bench-D", kv, timeout_s=120, secret=BENCH_SECRET)
        times = []
        for t in range(a.trials + 1):  # the first pull opens the channel: not timed
            plan = TransferPlan((GroupPlan(0, "full_attention", tuple(range(n)), tuple(range(n))),), 0, n * BLOCK_SHAPE[1])
            handle = TransferHandle("bench-P", address, f"r{t}", n * BLOCK_SHAPE[1])
            t0 = time.perf_counter()
            fetcher.submit(LoadJob(f"d{t}", handle, plan))
            while not (res := fetcher.take_results()).finished:
                time.sleep(0.0005)
            assert not res.failed, f"pull {t} failed"
            if t:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"{n * block_bytes / 1e6:>6.0f} {n:>7} {med:>9.3f} {n * block_bytes / med / 1e9:>6.2f}", flush=True)
        fetcher.stop()
        stop.set()
        proc.join(timeout=30)


if __name__ == "__main__":
    main()
