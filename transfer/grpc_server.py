"""P side of the gRPC transport: streams a transfer's KV blocks to D as they become ready.

Runs in P's worker process (where the KV tensors live), on a small thread pool
beside the model runner. One ReadBlocks call serves one transfer: it pins the
source (transfer/sources.py), then loops over the requested layers, sending each
run of blocks the forward pass has finished, and sleeping on the source table
until the next layer is done. A finished prefill is simply a source whose
every block is ready, so pull and push are the same code.

Authentication: every call must carry a token of the cluster secret (transfer/auth.py);
the server's interceptor refuses any other before its handler or request deserializer
runs, so a peer without the secret can read no transfer, release no lease, open no
channel and hold no server thread.

Flow control and memory: gRPC pulls from this generator only as fast as HTTP/2
flow control lets the stream drain to D, so at most one chunk (`chunk_bytes`)
plus the transport's window is buffered per stream, whatever the transfer size.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections import deque
from concurrent import futures

import grpc
import torch

from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer import kv_transfer_pb2_grpc as pb_grpc
from pdcluster.transfer.channel_store import StoreError
from pdcluster.transfer.channels import STALE_CHANNEL, ChannelHost
from pdcluster.transfer.dist_channel import ChannelError, Pending, TensorChannel
from pdcluster.transfer.grpc_auth import GrpcAuth, grpc_server_interceptor
from pdcluster.transfer.kv_seal import SealError, StreamSeal, kv_seal_key
from pdcluster.transfer.malloc_tuning import tune_malloc_for_transfer
from pdcluster.transfer.paged_kv import LayerInfo, PagedKv
from pdcluster.transfer.plan import NULL_BLOCK_ID
from pdcluster.transfer.sources import Source, SourceError, SourceTable

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # A peer whose host vanished (no FIN, no RST) is found by HTTP/2 pings: every 5 s while a
    # call is open, dead after 5 s unanswered. P then ends the stream it was stuck writing
    # (its blocks stay leased until D releases them or the lease ends).
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),
]
# P accepts D's pings at that rate (gRPC's default refuses pings under 5 min apart).
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 4000),
                  ("grpc.http2.max_ping_strikes", 0)]


def layout_of(engine_id: str, kv: PagedKv) -> pb.Layout:
    return pb.Layout(engine_id=engine_id, layers=[
        pb.LayerLayout(name=i.name, group=i.group, block_shape=list(i.block_shape), dtype=str(i.dtype).removeprefix("torch."))
        for i in kv.layers.values()
    ])


def chunk_runs(num_blocks: int, block_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(first, count) runs of at most chunk_bytes each (at least one block per run)."""
    per = max(1, chunk_bytes // block_bytes)
    return [(first, min(per, num_blocks - first)) for first in range(0, num_blocks, per)]


# Longest sleep between checks that D is still listening.
_POLL_S = 1.0
_ANSWER_MARGIN_S = 0.2
# Chunks in flight on a data channel, per stream: bounds P's copies held for sending.
SEND_WINDOW = 8
# A data channel's chunk: larger than gRPC's (bench/stream_throughput.py: gloo peaks
# at 16 MiB on loopback, where 1 MiB reached half of that).
CHANNEL_CHUNK_BYTES = 16 << 20


# A ReadBlocks stream holds a server thread from its call to its last chunk (push: through P's
# queue and its whole prefill). Streams get MAX_STREAMS threads; the unary calls (GetLayout,
# Release, OpenChannel) UNARY_THREADS more, so that however many D wait on P, a lease is
# always released at once. A stream past MAX_STREAMS is refused (RESOURCE_EXHAUSTED), not queued.
MAX_STREAMS = 64
UNARY_THREADS = 4


class KvTransferService(pb_grpc.KvTransferServicer):
    def __init__(self, engine_id: str, kv: PagedKv, sources: SourceTable, chunk_bytes: int, wait_s: float,
                 break_prefix: str | None = None, channels: ChannelHost | None = None,
                 channel_chunk_bytes: int = CHANNEL_CHUNK_BYTES, max_streams: int = MAX_STREAMS,
                 seal_key: bytes = b"", require_seal: bool = False):
        """`seal_key`: sealed streams' (kv_seal.py), for the D that ask; `require_seal`: refuse the
        others (spec transfer.encrypt)."""
        self._seal_key, self._require_seal = seal_key, require_seal
        self._streams = threading.BoundedSemaphore(max_streams)
        self._max_streams = max_streams
        self._engine_id = engine_id
        self._channel_chunk_bytes = channel_chunk_bytes
        self._channels = channels  # data channels D's opened (transfer.backend: torch_dist)
        self._break_prefix = break_prefix  # fault injection: see _stream
        self._kv = kv
        self._sources = sources
        self._chunk_bytes = chunk_bytes
        self._wait_s = wait_s  # for a transfer not yet on this P, when D set no deadline

    def GetLayout(self, request, context):
        return layout_of(self._engine_id, self._kv)

    def OpenChannel(self, request: pb.OpenChannelRequest, context):
        if self._channels is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"P {self._engine_id} serves KV over gRPC only: set the same transfer.backend on P and D")
        try:
            return self._channels.open(request.name)
        except ChannelError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))

    def ChannelStore(self, request: pb.StoreRequest, context):
        if self._channels is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"P {self._engine_id} has no data channels")
        try:
            return self._channels.stores.handle(request)
        except StoreError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))

    def ReadBlocks(self, request: pb.ReadBlocksRequest, context):
        if not self._streams.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"P {self._engine_id} is serving its "
                          f"{self._max_streams} transfer streams: transfer {request.transfer_id} refused")
        try:
            yield from self._read_blocks(request, context)
        finally:
            self._streams.release()

    def _read_blocks(self, request: pb.ReadBlocksRequest, context):
        # Answer before D's deadline, so D learns why rather than just "deadline exceeded".
        remaining = context.time_remaining()
        wait_s = self._wait_s if remaining is None else max(0.0, remaining - _ANSWER_MARGIN_S)
        try:
            src = self._sources.acquire(request.transfer_id, wait_s)
        except SourceError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        try:
            wanted = {gb.group: list(gb.block_indices) for gb in request.groups if gb.block_indices}
            self._check(src, wanted, context)
            seal = self._seal(request, context)
            channel = self._channel(request, context)
            if channel is not None and (why := channel.unusable) is not None:
                self._channels.drop(request.channel)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{STALE_CHANNEL} {request.channel!r}: {why}")
            try:
                yield from self._stream(src, wanted, context, channel, request.first_tag, seal)
            except ChannelError as err:
                self._channels.drop(request.channel)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"transfer {src.transfer_id}: {err}")
            except Exception:
                # Aborted with sends in flight: the pair is out of step now, D opens a new one.
                if channel is not None:
                    self._channels.drop(request.channel)
                raise
        finally:
            self._sources.unpin(src)

    def _seal(self, request: pb.ReadBlocksRequest, context) -> StreamSeal | None:
        if not request.seal:
            if self._require_seal:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"P {self._engine_id} sends KV sealed only "
                              f"(transfer.encrypt): transfer {request.transfer_id} asked for it in clear")
            return None
        if request.channel:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sealed KV travels inside the gRPC stream; "
                          "a torch_dist channel sends it as it is (transfer.encrypt needs backend grpc)")
        try:
            return StreamSeal(self._seal_key, request.seal)
        except SealError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    def _channel(self, request: pb.ReadBlocksRequest, context) -> TensorChannel | None:
        if not request.channel:
            return None
        if self._channels is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"P {self._engine_id} has no data channels")
        try:
            return self._channels.get(request.channel)
        except ChannelError as err:  # dropped after a failure D has not seen, or never joined
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{STALE_CHANNEL}: {err}")

    def _check(self, src: Source, wanted: dict[int, list[int]], context) -> None:
        for group, indices in wanted.items():
            if group >= len(src.block_sizes):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"transfer {src.transfer_id}: no group {group}")
            num_blocks = -(-src.num_tokens // src.block_sizes[group])
            if indices != sorted(set(indices)) or indices[-1] >= num_blocks:
                context.abort(grpc.StatusCode.OUT_OF_RANGE,
                              f"transfer {src.transfer_id}: group {group} asks for block indices {indices[:8]}..., "
                              f"not ascending or past the prompt's {num_blocks} blocks")

    def _stream(self, src: Source, wanted: dict[int, list[int]], context, channel: TensorChannel | None = None,
                first_tag: int = 0, seal: StreamSeal | None = None):
        """Chunks as they become ready: with the bytes inside, or announcing the tag they
        go under on `channel` (chunk k: first_tag + k; at most SEND_WINDOW in flight)."""
        in_flight: deque[Pending] = deque()
        chunk_bytes = self._chunk_bytes if channel is None else self._channel_chunk_bytes
        layers = [info for info in self._kv.layers.values() if info.group in wanted]
        sent = {info.name: 0 for info in layers}  # how many of the group's wanted blocks went out, per layer
        # Fault injection (tests): this transfer dies after half its blocks, as if P's host went away.
        break_after, blocks_sent, chunks_posted = None, 0, 0
        if self._break_prefix and src.transfer_id.startswith(self._break_prefix):
            break_after = max(1, sum(len(wanted[i.group]) for i in layers) // 2)
        while True:
            seen = dict(src.ready_tokens)
            for info in layers:
                indices = wanted[info.group]
                ready = bisect_left(indices, src.ready_blocks(info.vllm_layer, info.group))
                for first, count in chunk_runs(ready - sent[info.name], info.block_bytes, chunk_bytes):
                    first += sent[info.name]
                    if break_after is not None and blocks_sent >= break_after:
                        context.abort(grpc.StatusCode.UNAVAILABLE, f"transfer {src.transfer_id}: injected fault")
                    chunk = pb.KvChunk(layer=info.name, group=info.group, first=first, count=count)
                    if channel is None:
                        yield self._frame(src, info, indices[first:first + count], chunk, context, seal)
                    else:
                        blocks = self._gather(src, info, indices[first:first + count], context)
                        chunk.tag = first_tag + chunks_posted
                        chunks_posted += 1
                        if len(in_flight) >= SEND_WINDOW:
                            in_flight.popleft().wait()
                        in_flight.append(channel.send_async(blocks, chunk.tag))
                        yield frames.encode(chunk)
                    blocks_sent += count
                sent[info.name] = max(sent[info.name], ready)
            if all(sent[i.name] == len(wanted[i.group]) for i in layers):
                while in_flight:  # the stream ends once D has every byte
                    in_flight.popleft().wait()
                return
            if src.aborted:
                context.abort(grpc.StatusCode.ABORTED, f"P aborted the prefill of transfer {src.transfer_id}")
            if not context.is_active():
                return
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"transfer {src.transfer_id}: P not done in time")
            self._sources.wait_for_progress(src, seen, min(_POLL_S, remaining) if remaining else _POLL_S)

    def _block_ids(self, src: Source, info: LayerInfo, indices: list[int], context) -> list[int]:
        """P's block ids at these positions of the group's table; call under src.copy_lock."""
        table = src.block_ids[info.group] if info.group < len(src.block_ids) else ()
        if not indices or indices[-1] >= len(table):
            context.abort(grpc.StatusCode.ABORTED,
                          f"transfer {src.transfer_id}: P's block table lost blocks (preempted?)")
        ids = [table[i] for i in indices]
        if NULL_BLOCK_ID in ids:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"transfer {src.transfer_id}: group {info.group} blocks {indices} include one P "
                          f"already freed (outside the window?)")
        return ids

    def _pooled(self, src: Source, info: LayerInfo, indices: list[int], context) -> torch.Tensor:
        """A pooled source's blocks: the host tier's, pinned while it lives."""
        try:
            return src.tier.gather(info.name, info.group, indices)
        except KeyError as err:  # (a window group's block before the run's window)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"transfer {src.transfer_id}: {err.args[0]}")

    def _gather(self, src: Source, info: LayerInfo, indices: list[int], context) -> torch.Tensor:
        if src.tier is not None:
            return self._pooled(src, info, indices, context)
        with src.copy_lock:  # a preemption waits for this copy before P reuses the blocks
            return self._kv.gather(info.name, self._block_ids(src, info, indices, context))

    def _frame(self, src: Source, info: LayerInfo, indices: list[int], chunk: pb.KvChunk, context,
               seal: StreamSeal | None) -> bytes:
        """The chunk's frame, its blocks copied once: from P's cache straight into the frame (sealed:
        encrypted into it, then joined)."""
        if src.tier is not None:
            return frames.encode(chunk, self._pooled(src, info, indices, context), seal)
        with src.copy_lock:  # the views read the cache itself: P may not reuse the blocks meanwhile
            ids = self._block_ids(src, info, indices, context)
            runs = self._kv.byte_runs(info.name, ids)
            return frames.encode(chunk, runs if runs is not None else self._kv.gather_to_host(info.name, ids), seal)

    def Release(self, request: pb.ReleaseRequest, context):
        return pb.ReleaseReply(known=self._sources.release(request.transfer_id))


def _handlers(service: KvTransferService) -> grpc.GenericRpcHandler:
    """The generated registration, except ReadBlocks: it sends hand-made frames (transfer/frames.py)."""
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler("pdcluster.transfer.KvTransfer", {
        "GetLayout": unary(service.GetLayout, pb.LayoutRequest.FromString, pb.Layout.SerializeToString),
        "ReadBlocks": frames.read_blocks_handler(service.ReadBlocks),
        "OpenChannel": unary(service.OpenChannel, pb.OpenChannelRequest.FromString,
                             pb.OpenChannelReply.SerializeToString),
        "ChannelStore": unary(service.ChannelStore, pb.StoreRequest.FromString, pb.StoreReply.SerializeToString),
        "Release": unary(service.Release, pb.ReleaseRequest.FromString, pb.ReleaseReply.SerializeToString),
    })


class KvServer:
    """A gRPC server bound to host:port, serving one engine's transfer sources to the
    cluster's processes (those holding `secret`). `advertise`: the address D's dial
    (its channels' sockets bind there); default: host."""

    def __init__(self, engine_id: str, kv: PagedKv, sources: SourceTable, host: str, port: int, chunk_bytes: int,
                 *, secret: str, wait_s: float = 30.0, break_prefix: str | None = None,
                 channel_backend: str | None = None, channel_chunk_bytes: int = CHANNEL_CHUNK_BYTES,
                 max_streams: int = MAX_STREAMS, advertise: str | None = None, require_seal: bool = False):
        from pdcluster.transfer.dist_liveness import channel_liveness_key

        tune_malloc_for_transfer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + UNARY_THREADS,
                                                              thread_name_prefix="pdc-kv-server"),
                                   options=SERVER_OPTIONS,
                                   interceptors=[grpc_server_interceptor(GrpcAuth(secret), engine_id,
                                                                         f"KV service of {engine_id}")])
        # transfer.backend torch_dist: the bytes go over pair channels (transfer/channels.py).
        self._channels = (ChannelHost(advertise or host, channel_backend, wait_s, channel_liveness_key(secret))
                          if channel_backend else None)
        service = KvTransferService(engine_id, kv, sources, chunk_bytes, wait_s, break_prefix, self._channels,
                                    channel_chunk_bytes, max_streams, kv_seal_key(secret), require_seal)
        self._server.add_generic_rpc_handlers((_handlers(service),))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"KV server of {engine_id} cannot bind {host}:{port} (port in use?)")
        self.address = f"{host}:{bound}"
        self._server.start()
        log.info("KV server of %s listening on %s", engine_id, self.address)

    def stop(self) -> None:
        self._server.stop(grace=0)
        if self._channels is not None:
            self._channels.close()
