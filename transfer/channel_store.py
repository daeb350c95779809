"""The rendezvous store of P's torch.distributed data channels, inside P's gRPC KV service.

A two-rank process group (transfer/dist_channel.py) needs a c10d Store to swap its
ranks' addresses. c10d's TCPStore would be one more port that anyone reaching it can
read and write, with no way to authenticate them; so P keeps each channel's keys in
memory (`ChannelStores`) and D reaches them through the KV service's `ChannelStore`
call, which the service's interceptor admits only with the cluster secret
(transfer/auth.py). Both ends see a `dist.Store`: P a `LocalStore`, D a `RemoteStore`.

Each channel name has its own key space, made when D opens the channel and dropped
with it. Only what a rendezvous uses is served: set, get (waiting for the key), add,
check, wait; a get waits at most the store's timeout.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from pdcluster.transfer import kv_transfer_pb2 as pb

# A remote get waits on P for at most this long per call, then asks again (until its timeout):
# a gRPC call in flight holds one of P's server threads.
_REMOTE_WAIT_S = 5.0


class StoreError(RuntimeError):
    """A key did not appear in time, or the channel's key space is gone."""


class ChannelStores:
    """P's key spaces, one per channel name; thread-safe (gRPC threads and rendezvous threads)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._spaces: dict[str, dict[str, bytes]] = {}  # channel name -> its keys

    def create(self, name: str) -> None:
        with self._cond:
            assert name not in self._spaces, f"channel store {name!r} made twice: D must pick a new name per open"
            self._spaces[name] = {}

    def drop(self, name: str) -> None:
        with self._cond:
            self._spaces.pop(name, None)
            self._cond.notify_all()

    def _space(self, name: str) -> dict[str, bytes]:
        space = self._spaces.get(name)
        if space is None:
            raise StoreError(f"no channel {name!r} on this P (never opened, or dropped)")
        return space

    def set(self, name: str, key: str, value: bytes) -> None:
        with self._cond:
            self._space(name)[key] = bytes(value)
            self._cond.notify_all()

    def get(self, name: str, key: str, wait_s: float) -> bytes | None:
        """The key's value, waiting up to `wait_s` for it; None if it did not come."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while key not in self._space(name):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._spaces[name][key]

    def add(self, name: str, key: str, amount: int) -> int:
        with self._cond:
            space = self._space(name)
            value = int(space.get(key, b"0")) + amount
            space[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def handle(self, request: pb.StoreRequest) -> pb.StoreReply:
        """The ChannelStore call's body (the service maps StoreError to NOT_FOUND)."""
        if request.op == "set":
            self.set(request.channel, request.key, request.value)
            return pb.StoreReply(found=True)
        if request.op == "get":
            value = self.get(request.channel, request.key, min(request.wait_s, _REMOTE_WAIT_S))
            return pb.StoreReply(found=value is not None, value=value or b"")
        if request.op == "add":
            return pb.StoreReply(found=True, number=self.add(request.channel, request.key, request.amount))
        raise StoreError(f"unknown store op {request.op!r}")


class _Store(dist.Store):
    """The dist.Store methods a rendezvous calls, over `_set`, `_get`, `_add`."""

    def __init__(self, timeout_s: float):
        super().__init__()
        self._timeout_s = timeout_s

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def set(self, key: str, value) -> None:
        self._set(key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        value = self._get(key, self._timeout_s)
        if value is None:
            raise StoreError(f"key {key!r} did not appear within {self._timeout_s:.1f} s")
        return value

    def add(self, key: str, amount: int) -> int:
        return self._add(key, amount)

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._get(k, 0.0) is not None for k in keys)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + wait_s
        for key in keys:
            if self._get(key, max(0.0, deadline - time.monotonic())) is None:
                raise StoreError(f"key {key!r} did not appear within {wait_s:.1f} s")


class LocalStore(_Store):
    """P's end: one channel's key space, in this process."""

    def __init__(self, stores: ChannelStores, name: str, timeout_s: float):
        super().__init__(timeout_s)
        self._stores, self._name = stores, name

    def _set(self, key: str, value: bytes) -> None:
        self._stores.set(self._name, key, value)

    def _get(self, key: str, wait_s: float) -> bytes | None:
        return self._stores.get(self._name, key, wait_s)

    def _add(self, key: str, amount: int) -> int:
        return self._stores.add(self._name, key, amount)


class RemoteStore(_Store):
    """D's end: P's key space for one channel, through the KV service's ChannelStore call
    (`stub`: an authenticated KvTransfer stub, transfer/grpc_client.py)."""

    def __init__(self, stub, name: str, timeout_s: float):
        super().__init__(timeout_s)
        self._stub, self._name = stub, name

    def _call(self, request: pb.StoreRequest, wait_s: float = 0.0) -> pb.StoreReply:
        return self._stub.ChannelStore(request, timeout=wait_s + 10.0)

    def _set(self, key: str, value: bytes) -> None:
        self._call(pb.StoreRequest(channel=self._name, op="set", key=key, value=value))

    def _get(self, key: str, wait_s: float) -> bytes | None:
        deadline = time.monotonic() + wait_s
        while True:
            ask = min(_REMOTE_WAIT_S, max(0.0, deadline - time.monotonic()))
            reply = self._call(pb.StoreRequest(channel=self._name, op="get", key=key, wait_s=ask), ask)
            if reply.found:
                return reply.value
            if time.monotonic() >= deadline:
                return None

    def _add(self, key: str, amount: int) -> int:
        return self._call(pb.StoreRequest(channel=self._name, op="add", key=key, amount=amount)).number
