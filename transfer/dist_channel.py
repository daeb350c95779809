"""A torch.distributed point-to-point data channel between one P and one D worker.

Data plane only: the control plane stays gRPC (D asks P for a request's blocks
and tells it which tags to send them under); this module moves tensors. It
never touches torch.distributed's global default group (vLLM owns that in its
workers): each pair gets its own two-rank process group built from the
low-level pieces, P = rank 0, D = rank 1:

    the channel's store (in P's KV service, transfer/channel_store.py)
        -> PrefixStore("pdc-channel/<name>") -> ProcessGroupGloo/NCCL/HCCL

The backend comes from the device (`cluster.devices.DEVICES[...].collective_backend`):
gloo on CPU (the one tested here), nccl on CUDA, hccl on Ascend NPU (torch_npu's
ProcessGroupHCCL). The nccl/hccl branches are short and only import-checked on
this machine (no GPU, no NPU).

Every blocking call is bounded by the channel's timeout and raises ChannelError
naming the channel, the peer and the tag; nothing hangs. Beside the process group
each pair keeps one idle TCP connection (both ends prove the cluster secret on it)
whose only job is to close when a process dies: a peer that dies fails pending and
later operations within ~20 ms (gloo alone would not notice a peer that dies
mid-payload before its timeout); a peer whose host vanishes, within ~11 s
(keepalive); a silent peer makes them time out.

The backend's own sockets (gloo's pairs; NCCL's and HCCL's bootstrap) have no
authentication hook: their listening ports are exchanged only through the
authenticated store, and they carry KV bytes into preallocated buffers, never
anything deserialized. Keep them on a private network (`network.cidr`). After any ChannelError the channel is broken (later
posts raise at once): close it and open a new one under a new name, since what is
in flight on that pair can no longer be trusted.

Tags. Many transfers may be in flight over one pair at once, each chunk under its
own tag; a tag is a non-negative C int (gloo's limit). Each rank allocates tags only
from its own half of that space (rank r: [r * 2**30, (r + 1) * 2**30)), with a
counter that wraps, so the two sides never need to agree on an allocation: by
convention the receiver (D) allocates a request's tags (`allocate_tags(n)`) and
sends the first one to P in its gRPC request; P sends chunk k under first + k.
Two requests get disjoint ranges unless 2**30 tags are in flight at once.
Only gloo matches by tag. NCCL and HCCL ignore tags and match sends to receives
in posting order, so on those backends a pair runs one transfer at a time (D holds
`transfer()` for the whole of each), both sides posting chunks in the same order;
two at once would put one request's blocks into another's. On such a backend the
wire carries tag 0 whatever the chunk's tag (as gloo then behaves, which the tests use).

Staging. Gloo moves host memory: a non-CPU tensor on a gloo channel goes through
a pinned host buffer. NCCL and HCCL send device tensors directly, no staging.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import torch
import torch.distributed as dist

from pdcluster.transfer.dist_liveness import _liveness_pair, _PeerState, _watch

log = logging.getLogger(__name__)

ROLES = {"p": 0, "d": 1}  # P serves KV (rank 0, hosts the store), D receives it (rank 1)
TAG_SPACE_BITS = 30  # each rank's share of the C-int tag space
BACKENDS = ("gloo", "nccl", "hccl")
TAGGED_BACKENDS = ("gloo",)  # backends that match send to recv by tag (the others: by posting order)



class ChannelError(RuntimeError):
    """A channel operation failed or timed out; the message names the channel, peer and tag."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def _local_address_towards(host: str) -> str:
    """The address of this host's interface that routes to host (gloo binds its device to it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def local_address_towards(address: str) -> str:
    """For D: its own address on the route to P's `host:port`."""
    return _local_address_towards(address.rsplit(":", 1)[0].strip("[]"))


def _make_backend(backend: str, store: dist.Store, rank: int, timeout: datetime.timedelta, local_host: str):
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        opts._threads = 2
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":  # not exercised here (no GPU): import-checked only
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    if backend == "hccl":  # not exercised here (no NPU): as vllm-ascend builds its stateless groups
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, 2, opts)
    raise ValueError(f"unknown channel backend {backend!r}; one of {BACKENDS}")


def open_channel(role: str, store: dist.Store, backend: str, timeout_s: float, name: str, local_host: str,
                 auth_key: bytes, open_within: float | None = None) -> TensorChannel:
    """Open P's or D's end of the pair channel `name`; returns once both ends are connected.

    `store`: the channel's rendezvous store (transfer/channel_store.py: P's LocalStore, D's
    RemoteStore through P's KV service); `local_host`: the address this end's sockets bind
    and the peer dials (P's advertised address; D's address towards P); `auth_key`: the
    cluster's key for the liveness connection (`channel_liveness_key`). The whole open is
    bounded by `open_within` (default timeout_s, each later send's and receive's bound); an
    absent peer raises ChannelError. Use a fresh name for every open of a pair (e.g.
    "<p id>-<d id>-<generation>").
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown channel backend {backend!r}; one of {BACKENDS}")
    rank = ROLES[role]
    open_within = timeout_s if open_within is None else open_within
    deadline = time.monotonic() + open_within
    where = f"channel {name!r} ({backend}) as {role.upper()} on {local_host}"
    try:
        store.set_timeout(_td(deadline - time.monotonic()))
        pg = _make_backend(backend, dist.PrefixStore(f"pdc-channel/{name}", store), rank,
                           _td(deadline - time.monotonic()), local_host)
        alive = _liveness_pair(rank, store, f"pdc-channel-alive/{name}", local_host, deadline, auth_key)
    except Exception as err:  # c10d: DistStoreError, DistNetworkError, RuntimeError; store; socket: OSError
        peer = "D never joined" if rank == 0 else "P did not complete the rendezvous"
        raise ChannelError(f"{where}: {peer} within {open_within:.1f} s: {err}") from err
    return TensorChannel(pg, rank, backend, timeout_s, name, store, alive)


class Pending:
    """One posted send or receive; `wait()` returns once it is complete, or raises ChannelError.

    An operation must complete within the channel's timeout of being posted; a peer that
    dies fails it at once (within ~20 ms), whatever the backend is doing.
    """

    # The backend's wait() runs on a pool thread, so a caller can give up as soon as the liveness
    # connection reports the peer gone: a gloo wait cannot be interrupted (abort() and shutdown()
    # do not wake it) and gloo does not fail a receive whose peer dies mid-payload before its
    # timeout. Pool threads are not daemons: a Work must not be freed by a thread that the
    # interpreter's exit kills (std::terminate), so exit waits for a stuck wait (<= the timeout).

    def __init__(self, channel: TensorChannel, work, what: str, finish: list[Callable[[], object]], keep: tuple):
        self._channel = channel
        self._work = work
        self._what = what
        self._finish = finish  # run in order once the bytes have arrived
        self._keep = keep  # buffers the backend reads or writes until the work completes
        self._posted = time.monotonic()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._done = False
        channel._waiters.submit(self._block)

    def _block(self) -> None:
        try:
            self._work.wait(_td(self._channel.timeout_s))
        except BaseException as err:  # handed to the caller of wait()
            self._error = err
        self._event.set()

    def then(self, fn: Callable[[], object], keep: object = None) -> Pending:
        """Run fn after a successful wait (e.g. scatter a received chunk), keeping `keep` alive till then."""
        self._finish.append(fn)
        self._keep = (*self._keep, keep)
        return self

    def wait(self, until: float | None = None) -> None:
        """`until` (time.monotonic): give up there if sooner than the channel's timeout (a
        transfer's own deadline); the channel is then broken, as after a timeout."""
        if self._done:
            return
        ch = self._channel
        deadline = self._posted + ch.timeout_s + 0.25  # the backend's own timeout error, if it comes first
        if until is not None:
            deadline = min(deadline, until)
        while not self._event.wait(0.02):
            if ch._closed:
                raise ChannelError(f"channel {ch.name!r}: {self._what} abandoned: the channel was closed")
            if ch._gone is not None:
                raise ch._failed(f"{self._what} failed: {ch._gone}")
            if time.monotonic() > deadline:
                raise ch._failed(f"{self._what} timed out after {time.monotonic() - self._posted:.1f} s")
        if self._error is not None:
            elapsed = time.monotonic() - self._posted
            raise ch._failed(f"{self._what} failed after {elapsed:.2f} s: {self._error}") from self._error
        for fn in self._finish:
            fn()
        self._done = True
        self._keep = ()


class PairBusy(TimeoutError):
    """Another transfer held an untagged pair for longer than this one could wait (the pair is fine)."""


class TensorChannel:
    """One end of a P/D pair: tagged, bounded sends and receives of whole tensors."""

    def __init__(self, pg, rank: int, backend: str, timeout_s: float, name: str, store: dist.Store | None,
                 alive: socket.socket | None = None):
        self._pg = pg
        self.rank = rank
        self.peer = 1 - rank
        self.backend = backend
        self.timeout_s = timeout_s
        self.name = name
        self.tags_matched = backend in TAGGED_BACKENDS
        self._store = store  # kept alive as long as the channel
        self._lock = threading.Lock()
        self._one_transfer = threading.Lock()  # untagged backends: held by the transfer using the pair
        self._tags = itertools.count()
        self._broken: str | None = None
        self._peer = _PeerState()  # set by the liveness watcher
        self._closed = False
        self._waiters = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix=f"pdc-channel-{name}")
        self._alive = alive
        if alive is not None:
            # A daemon thread must hold no reference to the channel: freeing the process group
            # from a thread that the interpreter's exit is killing aborts the process.
            threading.Thread(target=_watch, args=(alive, self._peer, self._peer_name),
                             name=f"pdc-channel-alive-{name}", daemon=True).start()

    @property
    def _gone(self) -> str | None:
        return self._peer.gone

    def __repr__(self) -> str:
        return f"TensorChannel({self.name!r}, {self.backend}, rank {self.rank})"

    @property
    def unusable(self) -> str | None:
        """Why no transfer can use this channel any more (closed, broken, its peer gone), else None."""
        if self._closed:
            return "closed"
        return self._broken or self._gone

    @property
    def _peer_name(self) -> str:
        return "D (rank 1)" if self.peer == 1 else "P (rank 0)"

    def allocate_tags(self, n: int) -> int:
        """First of n consecutive tags from this rank's own space, unused by any other in-flight range."""
        if not 0 < n <= 1 << TAG_SPACE_BITS:
            raise ValueError(f"cannot allocate {n} tags")
        span = 1 << TAG_SPACE_BITS
        with self._lock:
            first = next(self._tags) % span
            if first + n > span:  # wrap: restart at the bottom of the space
                first = 0
            self._tags = itertools.count(first + n)
        return (self.rank << TAG_SPACE_BITS) + first

    @contextlib.contextmanager
    def transfer(self, wait_s: float) -> Iterator[None]:
        """Hold the pair for one whole transfer where the backend matches by posting order
        (a no-op where it matches by tag). Raises PairBusy if another transfer holds it for
        more than `wait_s`."""
        if self.tags_matched:
            yield
            return
        if not self._one_transfer.acquire(timeout=max(0.0, wait_s)):
            raise PairBusy(f"channel {self.name!r} ({self.backend}): another transfer held the pair for over "
                               f"{wait_s:.1f} s (one at a time: {self.backend} matches by posting order)")
        try:
            yield
        finally:
            self._one_transfer.release()

    def _wire_tag(self, tag: int) -> int:
        return tag if self.tags_matched else 0

    def _failed(self, message: str) -> ChannelError:
        full = f"channel {self.name!r} ({self.backend}, rank {self.rank}), peer {self._peer_name}: {message}"
        with self._lock:
            if self._broken is None:
                self._broken = full
        return ChannelError(full)

    def _check(self, what: str, tag: int) -> None:
        if self._closed:
            raise ChannelError(f"channel {self.name!r}: {what} after close")
        if self._broken is not None:
            raise ChannelError(f"channel {self.name!r}: {what} on a broken channel (first failure: {self._broken})")
        if self._gone is not None:
            raise self._failed(f"{what}: {self._gone}")
        if not 0 <= tag < 1 << (TAG_SPACE_BITS + 1):
            raise ValueError(f"tag {tag} outside [0, 2**{TAG_SPACE_BITS + 1})")

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The host buffer to move instead of `tensor` (None: move it as is)."""
        if self.backend == "gloo" and tensor.device.type != "cpu":
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if not tensor.is_contiguous():
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        return None

    def send_async(self, tensor: torch.Tensor, tag: int) -> Pending:
        what = f"send of tag {tag} ({tensor.nbytes} B) to {self._peer_name}"
        self._check(what, tag)
        buf = self._staged(tensor)
        if buf is not None:
            buf.copy_(tensor)
        src = tensor if buf is None else buf
        try:
            work = self._pg.send([src], self.peer, self._wire_tag(tag))
        except Exception as err:
            raise self._failed(f"{what} could not be posted: {err}") from err
        return Pending(self, work, what, [], (src,))

    def recv_async(self, tensor: torch.Tensor, tag: int) -> Pending:
        """Post a receive into `tensor` (its bytes are valid once `wait()` returns)."""
        what = f"recv of tag {tag} ({tensor.nbytes} B) from {self._peer_name}"
        self._check(what, tag)
        buf = self._staged(tensor)
        dst = tensor if buf is None else buf
        try:
            work = self._pg.recv([dst], self.peer, self._wire_tag(tag))
        except Exception as err:
            raise self._failed(f"{what} could not be posted: {err}") from err
        return Pending(self, work, what, [] if buf is None else [lambda: tensor.copy_(buf)], (dst,))

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self.send_async(tensor, tag).wait()

    def recv_into(self, tensor: torch.Tensor, tag: int) -> None:
        self.recv_async(tensor, tag).wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._peer.closed = True
        if self._alive is not None:
            try:
                self._alive.shutdown(socket.SHUT_RDWR)  # wakes our watcher; the peer's sees us leave
            except OSError:
                pass
            self._alive.close()
        self._waiters.shutdown(wait=False, cancel_futures=True)
        try:
            self._pg.shutdown()
        except Exception:  # best effort: the peer may be gone already
            pass
        self._pg = None
        self._store = None
