"""The request channel's wire: its messages, their codec, and one framed TCP connection.

The channel itself (who listens, who calls, liveness) is cluster/request_channel.py.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdcluster.cluster.messages import DecodeDelta, DecodeRequest, PrefillRequest, PrefillResult

Method = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Call:
    call_id: int  # unique per router connection; replies carry it back
    method: Method
    request: PrefillRequest | DecodeRequest


@dataclass(frozen=True)
class Abort:
    """Stop a call: the client went away or its deadline passed (the engine cancels its task,
    which aborts the request inside vLLM)."""

    call_id: int


@dataclass(frozen=True)
class Reply:
    call_id: int
    item: PrefillResult | DecodeDelta | None
    done: bool  # the call's last reply: prefill's result, decode's finished delta, or an end/error
    error: str | None = None  # the engine method raised: "ValueError: ..."


def encode(messages: list) -> bytes:
    return pickle.dumps(messages, protocol=5)


def decode(frame: bytes) -> list:
    return pickle.loads(frame)


_LENGTH = struct.Struct("!I")  # each frame's prefix: the pickled list's length in bytes


class EngineUnavailable(Exception):
    """The engine actor died, is restarting, or closed its channel."""


class EngineCallFailed(Exception):
    """The engine's method raised; the message is its exception's."""


class FramedConnection(asyncio.Protocol):
    """One TCP connection carrying lists of messages: messages posted during one loop turn
    leave at its end in one frame; each frame received is handed over whole.

    `on_messages(conn, messages)` per frame; `on_lost(conn)` once, when the connection
    closes for any reason (the peer's process exited, or `close()`).
    """

    def __init__(self, on_messages: Callable[[FramedConnection, list], None],
                 on_lost: Callable[[FramedConnection], None]):
        self.on_messages, self.on_lost = on_messages, on_lost
        self.transport: asyncio.Transport | None = None  # None once closed: posts are dropped
        self._received = bytearray()  # bytes of frames not complete yet
        self._outbox: list = []  # messages posted this loop turn
        self.frames_sent = self.messages_sent = 0  # batched: frames <= messages

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        # A frame is one write: Nagle would hold a small reply back for the peer's ACK.
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self._received
        buf += data
        start = 0
        while len(buf) - start >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buf, start)
            end = start + _LENGTH.size + n
            if len(buf) < end:
                break
            frame = decode(buf[start + _LENGTH.size:end])
            start = end
            self.on_messages(self, frame)
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(self)

    def post(self, msg) -> None:
        if not self._outbox:  # the first of this loop turn: send them all at its end
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(msg)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # at once; what is unsent no longer matters to either side

    def _flush(self) -> None:
        msgs, self._outbox = self._outbox, []
        if self.transport is None:
            return
        frame = encode(msgs)
        self.transport.writelines([_LENGTH.pack(len(frame)), frame])
        self.frames_sent += 1
        self.messages_sent += len(msgs)
