"""D side of the gRPC transport: receives planned blocks from P into D's cache.

Runs in D's worker process. Each load is one job on a small thread pool, so the
model runner keeps decoding other requests while KV arrives; P streams the
blocks as its forward pass produces them (or at once, if the prefill finished).
A job ends in exactly one of `finished` or `failed` (reported once via
`take_results`), and always tries to release P's source, whatever happened.
`cancel` ends a job early (D's request was aborted).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from pdcluster.proto.handle import TransferHandle
from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer import kv_transfer_pb2_grpc as pb_grpc
from pdcluster.transfer.channels import ChannelPool, is_stale_channel
from pdcluster.transfer.dist_channel import PairBusy, Pending, TensorChannel
from pdcluster.transfer.grpc_auth import REFUSED_HINT, GrpcAuth, grpc_authenticated_channel, is_refusal
from pdcluster.transfer.grpc_server import GRPC_OPTIONS, SEND_WINDOW, layout_of
from pdcluster.transfer.kv_seal import SealError, StreamSeal, kv_seal_key, new_stream_nonce
from pdcluster.transfer.malloc_tuning import tune_malloc_for_transfer
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.plan import TransferPlan

log = logging.getLogger(__name__)

# D's channels retry a lost P every 0.5 s at most (gRPC's default backoff grows to
# 2 min, so a P restarted by Ray would stay unreachable long after it is back),
# and a job waits up to CONNECT_S for its P to accept a connection.
# Each channel its own connection (not gRPC's process-wide subchannel pool): a channel made anew
# after a lost connection really dials P again (`_fresh_stub`).
CLIENT_OPTIONS = [*GRPC_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500),
                  ("grpc.use_local_subchannel_pool", 1)]
MAX_WAITING_LOADS = 256  # loads queued for D's fetch threads before a new one fails at once
CONNECT_S = 5.0
RELEASE_S = 5.0  # D's word to P that a lease may end
RELEASE_AFTER_FAILURE_S = 1.0  # P may be cut off; its lease ends on its own


class TransferError(RuntimeError):
    pass


def _connection_lost(err: BaseException) -> bool:
    """A call that failed for its connection (UNAVAILABLE, not P's word on a stale data channel)."""
    return (isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
            and not is_stale_channel(err))


@dataclass(frozen=True)
class LoadJob:
    request_id: str  # D's request id
    handle: TransferHandle
    plan: TransferPlan  # empty when D already holds everything: only release P's source


@dataclass(frozen=True)
class PullTiming:
    """One pull as D's worker saw it (time.monotonic_ns of this host)."""

    start_ns: int
    end_ns: int
    bytes_per_group: tuple[int, ...]
    error: str | None = None  # why it failed, in a line (None: it did not)


@dataclass
class LoadResults:
    finished: set[str] = field(default_factory=set)  # loaded, or failed (vLLM wants both here)
    failed: set[str] = field(default_factory=set)
    timings: dict[str, PullTiming] = field(default_factory=dict)  # every pull that ran, failed ones too


def kv_stub(address: str, auth: GrpcAuth, server: str) -> tuple[grpc.Channel, pb_grpc.KvTransferStub]:
    """A channel to P's KV service at `address` and its stub, every call carrying a token for
    `server` (that P's engine id)."""
    channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
    return channel, frames.framed_stub(grpc_authenticated_channel(channel, auth, server))


def release_on(stub: pb_grpc.KvTransferStub, handle: TransferHandle, timeout_s: float) -> bool:
    """End P's lease on `handle`'s blocks now. False if P knew no such transfer or could not be
    reached: its lease then ends on its own; nothing is lost but time."""
    try:
        return stub.Release(pb.ReleaseRequest(transfer_id=handle.transfer_id), timeout=timeout_s).known
    except grpc.RpcError as err:
        log.warning("could not release %s on %s: %s", handle.transfer_id, handle.address, err.code())
        return False


def release_at_p(handle: TransferHandle, secret: str, timeout_s: float = RELEASE_AFTER_FAILURE_S) -> bool:
    """`release_on` over a channel of its own, for a request D's connector never saw (vLLM's input
    checks refused it on D): its blocks would wait for transfer.lease_s."""
    channel, stub = kv_stub(handle.address, GrpcAuth(secret), handle.engine_id)
    try:
        return release_on(stub, handle, timeout_s)
    finally:
        channel.close()


class KvFetcher:
    """A job whose handle asks for transport torch_dist receives its bytes over a
    torch.distributed pair channel to its P (opened on first use), which the gRPC
    stream then only announces; otherwise the bytes come inside the stream."""

    def __init__(self, engine_id: str, kv: PagedKv, timeout_s: float, max_workers: int = 4, *, secret: str,
                 max_waiting: int = MAX_WAITING_LOADS, seal: bool = False):
        """A load waits for one of `max_workers` threads; past `max_waiting` loads waiting, a new
        one fails at once (its request recomputes or fails, per transfer.on_failure) rather than
        join a queue it would only leave after its time is up. Each load has `timeout_s` from
        its submission, its wait for a thread included. `seal`: ask P to seal each stream's bytes
        (kv_seal.py; spec transfer.encrypt)."""
        self._seal_key = kv_seal_key(secret) if seal else None
        from pdcluster.transfer.dist_liveness import channel_liveness_key

        tune_malloc_for_transfer()
        self._engine_id = engine_id
        self._auth = GrpcAuth(secret)  # every call proves the cluster secret to P's KV service
        self._channels = ChannelPool(engine_id, timeout_s, channel_liveness_key(secret))
        self._kv = kv
        self._timeout_s = timeout_s
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pdc-kv-fetch")
        self._max_waiting = max_waiting
        self._waiting = 0  # loads submitted whose thread has not started them
        self._releases = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdc-kv-release")
        self._lock = threading.Lock()
        self._results = LoadResults()
        # (P's address, its engine id) -> (channel, stub); filled from pool threads, hence the lock.
        self._stubs: dict[tuple[str, str], tuple[grpc.Channel, pb_grpc.KvTransferStub]] = {}
        self._checked_peers: set[str] = set()
        # request_id -> its ReadBlocks call (None until it starts), for every job not yet ended.
        self._calls: dict[str, grpc.Future | None] = {}
        self._cancelled: set[str] = set()  # jobs told to stop; a subset of _calls' keys

    def submit(self, job: LoadJob) -> None:
        with self._lock:
            if job.plan.num_blocks and self._waiting >= self._max_waiting:
                log.error("KV load of %s from %s refused: %d loads already wait for D's %d fetch threads",
                          job.request_id, job.handle.address, self._waiting, self._pool._max_workers)
                self._results.finished.add(job.request_id)
                self._results.failed.add(job.request_id)
                refused = True
            else:
                self._calls[job.request_id] = None
                self._waiting += 1
                refused = False
        if refused:  # P's lease ends now, not after lease_s (and not behind the loads it could not join)
            self._releases.submit(self._release, job, RELEASE_AFTER_FAILURE_S)
            return
        self._pool.submit(self._run, job, time.monotonic() + self._timeout_s)

    def cancel(self, request_id: str) -> None:
        """Stop a load whose request D no longer wants; it still reports (as failed)."""
        with self._lock:
            if request_id not in self._calls:
                return  # already ended
            self._cancelled.add(request_id)
            call = self._calls[request_id]
        if call is not None:
            call.cancel()

    def take_results(self) -> LoadResults:
        with self._lock:
            out, self._results = self._results, LoadResults()
            return out

    def _stub(self, handle: TransferHandle) -> pb_grpc.KvTransferStub:
        key = (handle.address, handle.engine_id)  # tokens are bound to the P's name
        with self._lock:
            if key not in self._stubs:
                self._stubs[key] = kv_stub(handle.address, self._auth, handle.engine_id)
            return self._stubs[key][1]

    def _fresh_stub(self, handle: TransferHandle) -> pb_grpc.KvTransferStub:
        """A new channel to P in place of the one cached (jobs on the old one finish on it)."""
        with self._lock:
            self._stubs[(handle.address, handle.engine_id)] = kv_stub(handle.address, self._auth, handle.engine_id)
        return self._stub(handle)

    def _check_peer(self, stub: pb_grpc.KvTransferStub, handle: TransferHandle, deadline: float) -> None:
        """Once per P (and again after a failure): wait for it to accept a connection, compare layouts."""
        if handle.address in self._checked_peers:
            return
        wait_s = max(0.01, min(CONNECT_S, deadline - time.monotonic()))
        try:
            theirs = stub.GetLayout(pb.LayoutRequest(), timeout=wait_s, wait_for_ready=True)
        except grpc.RpcError as err:
            if is_refusal(err):
                raise TransferError(f"P at {handle.address} {REFUSED_HINT}") from None
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self._fresh_stub(handle)  # the next job dials anew, not behind this connection's attempt
            raise TransferError(f"P at {handle.address} accepts no connection (waited {wait_s:.0f} s)") from None
        mine = layout_of(self._engine_id, self._kv)
        strip = lambda layout: [(l.name, l.group, list(l.block_shape), l.dtype) for l in layout.layers]  # noqa: E731
        if strip(theirs) != strip(mine):
            raise TransferError(f"P {theirs.engine_id} at {handle.address} has a different KV layout than D "
                                f"{self._engine_id}: different model, dtype or block size")
        self._checked_peers.add(handle.address)

    def _run(self, job: LoadJob, deadline: float) -> None:
        """`deadline`: the whole job's, from its submission: its wait for a thread, connect, layout
        check, stream."""
        with self._lock:
            self._waiting -= 1
        ok, why = False, None
        start_ns = time.monotonic_ns()
        bytes_per_group = [0] * len(job.plan.groups)
        try:
            if time.monotonic() >= deadline:
                raise TransferError(f"waited for a fetch thread past its {self._timeout_s:.0f} s")
            stub = self._stub(job.handle)
            if job.plan.num_blocks:
                self._check_peer(stub, job.handle, deadline)
                self._pull(stub, job, bytes_per_group, deadline)
            ok = True
        except Exception as err:  # any failure fails this request, never the engine
            self._checked_peers.discard(job.handle.address)  # P may have restarted: wait for it next time
            why = (f"{err.code().name} from P at {job.handle.address}: {err.details()}" if isinstance(err, grpc.RpcError)
                   else str(err) or type(err).__name__)
            log.error("KV load of %s from %s failed: %s", job.request_id, job.handle.address, why)
        finally:
            with self._lock:
                self._calls.pop(job.request_id, None)
                self._cancelled.discard(job.request_id)
            if ok:  # P's blocks free before D reports the load: the request's end finds P's cache free
                self._release(job, timeout_s=RELEASE_S)
            # Only requests vLLM parked for this load wait for a result (a
            # release-only job is for a request that is not waiting).
            if job.plan.num_blocks:
                timing = PullTiming(start_ns, time.monotonic_ns(), tuple(bytes_per_group), why)
                with self._lock:
                    self._results.finished.add(job.request_id)
                    self._results.timings[job.request_id] = timing
                    if not ok:
                        self._results.failed.add(job.request_id)
            if not ok:  # after the result: P may be cut off, and the request must not wait on it
                self._release(job, timeout_s=RELEASE_AFTER_FAILURE_S)  # P's lease ends on its own anyway

    def _pull(self, stub: pb_grpc.KvTransferStub, job: LoadJob, bytes_per_group: list[int],
              deadline: float) -> None:
        t0 = time.perf_counter()
        request = pb.ReadBlocksRequest(transfer_id=job.handle.transfer_id, groups=[
            pb.GroupBlocks(group=g.group, block_indices=list(g.remote_indices)) for g in job.plan.groups if g.num_blocks
        ])
        # Every (layer, block) of the plan must arrive exactly once.
        expected = {layer.name: job.plan.groups[layer.group].num_blocks
                    for layer in self._kv.layers.values() if job.plan.groups[layer.group].num_blocks}
        if self._seal_key is not None and job.handle.transport != "grpc":
            raise TransferError(f"transfer.encrypt seals KV inside gRPC streams; transport {job.handle.transport} "
                                "would send it in clear")
        for attempt in (1, 2):
            channel = None
            if job.handle.transport == "torch_dist":
                channel = self._channels.get(job.handle.address, stub, deadline)
                request.channel = channel.name
                # P tags its k-th chunk first_tag + k; a chunk holds at least one block.
                request.first_tag = channel.allocate_tags(sum(expected.values()))
            # NCCL and HCCL match by posting order: the pair carries one transfer at a time.
            holding = contextlib.nullcontext() if channel is None else channel.transfer(deadline - time.monotonic())
            try:
                with holding:
                    self._receive(stub, job, request, expected, channel, bytes_per_group, deadline)
                break
            except PairBusy as err:  # the pair stayed busy: this transfer's time is up, the pair is fine
                raise TransferError(str(err)) from None
            except Exception as err:
                # A transfer that failed midway may leave sends or receives posted: P drops its end
                # too (grpc_server.ReadBlocks), and the next transfer opens a new pair.
                if channel is not None:
                    self._channels.drop(job.handle.address, channel)
                if attempt == 1 and is_stale_channel(err):  # P sent nothing: once more on a new pair
                    log.info("P %s found channel %s dead before sending: %s on a new one",
                             job.handle.address, channel.name, job.request_id)
                    continue
                if attempt == 1 and _connection_lost(err) and not any(bytes_per_group) and time.monotonic() < deadline:
                    # Nothing came: the connection died under the call (a cut that healed leaves
                    # one for dead); once more on a new connection, within the same deadline.
                    log.info("lost the connection to P %s before any KV of %s came (%s): once more on a new one",
                             job.handle.address, job.request_id, err.details())
                    stub = self._fresh_stub(job.handle)
                    continue
                raise
        log.info("received %d blocks (%.1f MB) of %s from %s in %.1f ms", job.plan.num_blocks,
                 sum(bytes_per_group) / 1e6, job.request_id, job.handle.address, (time.perf_counter() - t0) * 1e3)

    def _receive(self, stub: pb_grpc.KvTransferStub, job: LoadJob, request: pb.ReadBlocksRequest,
                 expected: dict[str, int], channel: TensorChannel | None, bytes_per_group: list[int],
                 deadline: float) -> None:
        received: dict[str, set[int]] = {name: set() for name in expected}
        in_flight: deque[Pending] = deque()
        seal = None
        if self._seal_key is not None:  # a new stream nonce, so a new key, for every stream
            request.seal = new_stream_nonce()
            seal = StreamSeal(self._seal_key, request.seal)
        # wait_for_ready: a channel still reconnecting (P's host back from a cut: its backoff is at
        # most 0.5 s) holds the call until it is up, within the deadline, instead of failing it.
        call = stub.ReadBlocks(request, timeout=max(0.01, deadline - time.monotonic()), wait_for_ready=True)
        with self._lock:
            self._calls[job.request_id] = call
            if job.request_id in self._cancelled:  # cancelled before the call started
                call.cancel()
        for frame in call:
            chunk = frame.chunk
            if chunk.layer not in expected:
                raise TransferError(f"P sent layer {chunk.layer!r} that D does not expect")
            local = job.plan.groups[chunk.group].local_block_ids[chunk.first:chunk.first + chunk.count]
            if len(local) != chunk.count:
                raise TransferError(f"P sent blocks {chunk.first}..{chunk.first + chunk.count} of group "
                                    f"{chunk.group}, past the {job.plan.groups[chunk.group].num_blocks} planned")
            indices = set(range(chunk.first, chunk.first + chunk.count))
            if indices & received[chunk.layer]:
                raise TransferError(f"P sent blocks {chunk.first}..{chunk.first + chunk.count} of {chunk.layer} twice")
            if channel is None:
                try:
                    data = frame.data if seal is None else seal.open(frame.head, frame.data)
                except SealError as err:
                    raise TransferError(f"P {job.handle.address}: {err}") from None
                self._kv.write(chunk.layer, local, data)
            else:
                if len(in_flight) >= SEND_WINDOW:
                    in_flight.popleft().wait(deadline)
                in_flight.append(self._post_recv(channel, chunk.layer, local, chunk.tag))
            received[chunk.layer] |= indices
            bytes_per_group[chunk.group] += chunk.count * self._kv.layers[chunk.layer].block_bytes
        while in_flight:
            in_flight.popleft().wait(deadline)
        if any(len(received[k]) != v for k, v in expected.items()):
            short = {k: (len(received[k]), v) for k, v in expected.items() if len(received[k]) != v}
            raise TransferError(f"incomplete transfer, (received, expected) blocks per layer: {short}")

    def _post_recv(self, channel: TensorChannel, layer: str, local: tuple[int, ...], tag: int) -> Pending:
        """Receive a chunk straight into D's blocks when they are consecutive, else via a buffer."""
        view = self._kv.view(layer)
        if all(b == local[0] + i for i, b in enumerate(local)) and view[local[0]:local[-1] + 1].is_contiguous():
            return channel.recv_async(view[local[0]:local[-1] + 1], tag)
        buf = torch.empty((len(local), *view.shape[1:]), dtype=view.dtype, device=view.device)
        idx = torch.tensor(local, dtype=torch.long, device=view.device)
        return channel.recv_async(buf, tag).then(lambda: view.index_copy_(0, idx, buf), keep=buf)

    def _release(self, job: LoadJob, timeout_s: float) -> None:
        release_on(self._stub(job.handle), job.handle, timeout_s)

    def stop(self) -> None:
        """End every load (running ones as cancelled), then close the channels: a channel closed
        under a call still running on it can crash the process inside gRPC's C core (a worker
        of the unit suite once died so). Waits at most the longest call's own timeout."""
        with self._lock:
            running = list(self._calls)
        for request_id in running:
            self.cancel(request_id)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._releases.shutdown(wait=True, cancel_futures=True)
        self._channels.close()
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()
