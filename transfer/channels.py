"""Both ends' bookkeeping of torch.distributed data channels (transfer.backend: torch_dist).

gRPC stays the control plane: D asks P for a transfer's blocks over gRPC, and P
streams back one header per chunk; the bytes go over a pair channel
(transfer/dist_channel.py: gloo on CPU, nccl on CUDA, hccl on Ascend), one per
(P, D) pair, opened on D's first transfer from that P:

    D: OpenChannel(name) --gRPC--> P: hosts a TCPStore (once), answers its port,
                                      joins the rendezvous in the background
    D: joins the rendezvous with the port    -> both ends hold the channel

A channel that fails is dropped on both sides; the next transfer opens a new
one under a new name (what was in flight on the old pair cannot be trusted).
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent import futures

from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.dist_channel import ChannelError, TensorChannel, host_store, open_channel

log = logging.getLogger(__name__)


class ChannelHost:
    """P's end: one store, and the channels D's have opened to it by name."""

    def __init__(self, host: str, backend: str, timeout_s: float):
        self._host, self._backend, self._timeout_s = host, backend, timeout_s
        self._lock = threading.Lock()
        self._store = None
        self._opening: dict[str, futures.Future] = {}  # name -> future of the TensorChannel
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdc-channel-open")

    def open(self, name: str) -> pb.OpenChannelReply:
        with self._lock:
            if self._store is None:
                self._store = host_store(self._host, 0, self._timeout_s)
            if name in self._opening:
                raise ChannelError(f"channel {name!r} opened twice: D must pick a new name per open")
            self._opening[name] = self._pool.submit(open_channel, "p", self._host, self._store.port, self._backend,
                                                    self._timeout_s, name, store=self._store)
            return pb.OpenChannelReply(store_port=self._store.port, backend=self._backend)

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
        if opening is not None and opening.done() and opening.exception() is None:
            opening.result().close()

    def close(self) -> None:
        with self._lock:
            names = list(self._opening)
        for name in names:
            self.drop(name)
        self._pool.shutdown(wait=False, cancel_futures=True)


class ChannelPool:
    """D's end: one open channel per P address."""

    def __init__(self, engine_id: str, timeout_s: float):
        self._engine_id, self._timeout_s = engine_id, timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, TensorChannel] = {}
        self._opens = itertools.count()

    def get(self, address: str, stub) -> TensorChannel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is not None:
                return ch
            name = f"{address}/{self._engine_id}/{next(self._opens)}"
            # Opening under the lock: concurrent first transfers to one P wait for a single rendezvous.
            reply = stub.OpenChannel(pb.OpenChannelRequest(name=name), timeout=self._timeout_s)
            host = address.rsplit(":", 1)[0]
            ch = open_channel("d", host, reply.store_port, reply.backend, self._timeout_s, name)
            self._channels[address] = ch
            log.info("opened %s data channel %s", reply.backend, name)
            return ch

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
