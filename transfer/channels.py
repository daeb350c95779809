"""Both ends' bookkeeping of torch.distributed data channels (transfer.backend: torch_dist).

gRPC stays the control plane: D asks P for a transfer's blocks over gRPC, and P
streams back one header per chunk; the bytes go over a pair channel
(transfer/dist_channel.py: gloo on CPU, nccl on CUDA, hccl on Ascend), one per
(P, D) pair, opened on D's first transfer from that P:

    D: OpenChannel(name) --gRPC--> P: makes the channel's store (transfer/channel_store.py),
                                      answers, joins the rendezvous in the background
    D: joins the rendezvous through ChannelStore calls -> both ends hold the channel

Every call is P's authenticated KV service, so the rendezvous is the cluster's alone.
A channel that fails is dropped on both sides; the next transfer opens a new one
under a new name (what was in flight on the old pair cannot be trusted).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from concurrent import futures

import grpc

from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.channel_store import ChannelStores, LocalStore, RemoteStore
from pdcluster.transfer.dist_channel import ChannelError, TensorChannel, local_address_towards, open_channel
from pdcluster.transfer.grpc_auth import REFUSED_HINT, is_refusal

log = logging.getLogger(__name__)

# P's answer to a ReadBlocks on a channel it already knows is dead (its liveness connection saw
# the peer go, e.g. during a cut D's end has not noticed yet): nothing was sent, so D retries the
# transfer once on a new pair instead of failing the request.
STALE_CHANNEL = "stale data channel"


def is_stale_channel(err: BaseException) -> bool:
    """Whether a ReadBlocks call failed because P found its end of the channel dead before sending."""
    return (isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
            and (err.details() or "").startswith(STALE_CHANNEL))


class ChannelHost:
    """P's end: the channels D's have opened to it by name, and their stores.
    `host`: P's advertised address (its end of every pair binds and is dialled there)."""

    def __init__(self, host: str, backend: str, timeout_s: float, auth_key: bytes):
        self._host, self._backend, self._timeout_s, self._auth_key = host, backend, timeout_s, auth_key
        self._lock = threading.Lock()
        self.stores = ChannelStores()  # served by the KV service's ChannelStore call
        self._opening: dict[str, futures.Future] = {}  # name -> future of the TensorChannel
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdc-channel-open")

    def open(self, name: str) -> pb.OpenChannelReply:
        """A D opens `name` (`<P address>/<D engine id>/<D's nonce>-<n>`, ChannelPool.get). D keeps
        one channel per P: the channels it opened before are dead to it (it found them unusable,
        or it is a restarted D), so P frees them now, as it does any whose peer went."""
        owner = name.rsplit("/", 1)[0]
        with self._lock:
            if name in self._opening:
                raise ChannelError(f"channel {name!r} opened twice: D must pick a new name per open")
            stale = [n for n, f in self._opening.items()
                     if n.rsplit("/", 1)[0] == owner or f.done() and f.exception() is None and f.result().unusable]
        for old in stale:
            log.info("data channel %s: freed (its D opened %s, or it is gone)", old, name)
            self.drop(old)
        with self._lock:
            if name in self._opening:
                raise ChannelError(f"channel {name!r} opened twice: D must pick a new name per open")
            self.stores.create(name)
            store = LocalStore(self.stores, name, self._timeout_s)
            self._opening[name] = self._pool.submit(open_channel, "p", store, self._backend, self._timeout_s, name,
                                                    self._host, self._auth_key)
            return pb.OpenChannelReply(backend=self._backend)

    def opened(self) -> list[str]:
        """The names of the channels D's have opened (and not dropped)."""
        with self._lock:
            return list(self._opening)

    def get(self, name: str) -> TensorChannel:
        """The channel `name`, once its rendezvous is done (bounded by the channel timeout)."""
        with self._lock:
            opening = self._opening.get(name)
        if opening is None:
            raise ChannelError(f"no channel {name!r} on this P (never opened, or dropped after a failure)")
        try:
            return opening.result(timeout=self._timeout_s + 1)
        except futures.TimeoutError:
            raise ChannelError(f"channel {name!r}: D never joined") from None

    def drop(self, name: str) -> None:
        with self._lock:
            opening = self._opening.pop(name, None)
        self.stores.drop(name)
        if opening is not None:  # now, or once its open ends: one still opening must not live on
            opening.add_done_callback(lambda f: f.exception() is None and f.result().close())

    def close(self) -> None:
        with self._lock:
            names = list(self._opening)
        for name in names:
            self.drop(name)
        self._pool.shutdown(wait=False, cancel_futures=True)


class ChannelPool:
    """D's end: one open channel per P address."""

    def __init__(self, engine_id: str, timeout_s: float, auth_key: bytes):
        self._engine_id, self._timeout_s, self._auth_key = engine_id, timeout_s, auth_key
        self._lock = threading.Lock()
        self._channels: dict[str, TensorChannel] = {}
        # Names unique to this process: a restarted D (same engine id) reuses none of its
        # predecessor's, which P may still hold.
        self._nonce = secrets.token_hex(6)
        self._opens = itertools.count()

    def get(self, address: str, stub, deadline: float | None = None) -> TensorChannel:
        """`stub`: an authenticated KvTransfer stub of the P at `address`; `deadline`
        (time.monotonic) bounds the wait for another open and this one's (default: timeout_s)."""
        deadline = time.monotonic() + self._timeout_s if deadline is None else deadline
        # Opening under the lock: concurrent first transfers to one P wait for a single rendezvous.
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ChannelError(f"P at {address}: another data channel's open outlasted this transfer's time")
        try:
            ch = self._channels.get(address)
            if ch is not None and (why := ch.unusable) is not None:
                # E.g. its liveness connection timed out while the link to P was cut: a new pair.
                log.info("data channel %s is unusable (%s): opening a new one", ch.name, why)
                del self._channels[address]
                ch.close()
                ch = None
            if ch is not None:
                return ch
            name = f"{address}/{self._engine_id}/{self._nonce}-{next(self._opens)}"
            left = lambda: max(0.01, deadline - time.monotonic())  # noqa: E731
            try:
                reply = stub.OpenChannel(pb.OpenChannelRequest(name=name), timeout=left())
            except grpc.RpcError as err:
                why = REFUSED_HINT if is_refusal(err) else err.details()
                raise ChannelError(f"P at {address} did not open channel {name!r}: {err.code().name}: {why}") from None
            ch = open_channel("d", RemoteStore(stub, name, left()), reply.backend, self._timeout_s, name,
                              local_address_towards(address), self._auth_key, open_within=left())
            self._channels[address] = ch
            log.info("opened %s data channel %s", reply.backend, name)
            return ch
        finally:
            self._lock.release()

    def drop(self, address: str, ch: TensorChannel) -> None:
        with self._lock:
            if self._channels.get(address) is ch:
                del self._channels[address]
        ch.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()
