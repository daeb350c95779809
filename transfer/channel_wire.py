"""The request channel's wire: its messages, their codec, and one framed TCP connection.

Wire: the engine listens on its node's address (transfer/network.py; it may serve
several routers, a connection each), the router connects. Before anything else, both
prove they hold the cluster secret (transfer/auth.py's handshake: the engine reads one
fixed-size proof and drops a connection that sends anything else). Then each frame is a
4-byte big-endian length and, sealed with the connection's session key (transfer/session.py:
AES-GCM, the frame's number as nonce; prompts and completions cross in it), a msgpack
list of typed messages (msgspec: the decoder
builds exactly these classes and the messages.py dataclasses inside them, and nothing
else; no pickle): router -> engine `PrefillCall`, `DecodeCall`, `PoolCall`, `Abort`; engine ->
router `PrefillReply`, `DecodeReply`, `PoolReply`. Plain asyncio TCP rather than ZMQ: ZMQ's I/O
thread adds a thread hop each way (a round trip ~200 us here against ~110; P's and D's
calls at one connection 0.67 -> 0.32 ms, bench/README.md "The router's own overhead").

The channel itself (who listens, who calls, liveness) is transfer/request_channel.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Literal

import msgspec

from pdcluster.proto.messages import DecodeDelta, DecodeRequest, PoolOffer, PoolRequest, PrefillRequest, PrefillResult
from pdcluster.transfer.auth import HANDSHAKE_TIMEOUT_S, AuthError, ClientHandshake, ServerHandshake, derive
from pdcluster.transfer.network import host_port
from pdcluster.transfer.session import TAG_BYTES, FrameSeal, SealError

log = logging.getLogger(__name__)

Method = Literal["prefill", "decode", "open_pool"]
# A peer whose host vanished (no FIN): keepalive probes after 5 s idle, every 2 s, 3 unanswered
# end it (~11 s); unacknowledged data ends it after TCP_USER_TIMEOUT.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 3
USER_TIMEOUT_S = 10
DEAD_PEER_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES


class PrefillCall(msgspec.Struct, tag="prefill", array_like=True, frozen=True):
    call_id: int  # unique per router connection; replies carry it back
    request: PrefillRequest


class DecodeCall(msgspec.Struct, tag="decode", array_like=True, frozen=True):
    call_id: int
    request: DecodeRequest


class PoolCall(msgspec.Struct, tag="open_pool", array_like=True, frozen=True):
    call_id: int
    request: PoolRequest


class Abort(msgspec.Struct, tag="abort", array_like=True, frozen=True):
    """Stop a call: the client went away or its deadline passed (the engine cancels its task,
    which aborts the request inside vLLM)."""

    call_id: int


class PrefillReply(msgspec.Struct, tag="prefill", array_like=True, frozen=True):
    call_id: int
    item: PrefillResult | None
    done: bool  # the call's last reply: always, for a prefill
    error: str | None = None  # the engine method raised: "ValueError: ..."


class DecodeReply(msgspec.Struct, tag="decode", array_like=True, frozen=True):
    call_id: int
    item: DecodeDelta | None
    done: bool  # the call's last reply: the finished delta, or an end/error
    error: str | None = None


class PoolReply(msgspec.Struct, tag="open_pool", array_like=True, frozen=True):
    call_id: int
    item: PoolOffer | None
    done: bool  # always: one reply
    error: str | None = None


Reply = PrefillReply | DecodeReply | PoolReply
CALLS: dict[Method, type] = {"prefill": PrefillCall, "decode": DecodeCall, "open_pool": PoolCall}

_encode = msgspec.msgpack.Encoder().encode
# What each side accepts: anything else in a frame (a wrong type, a missing field) fails its decode.
ENGINE_INBOX = msgspec.msgpack.Decoder(list[PrefillCall | DecodeCall | PoolCall | Abort])
ROUTER_INBOX = msgspec.msgpack.Decoder(list[PrefillReply | DecodeReply | PoolReply])
_LENGTH = struct.Struct("!I")  # each frame's prefix: the sealed msgpack list's length in bytes
MAX_FRAME_BYTES = (256 << 20) + TAG_BYTES  # a 128K-id prompt is ~400 KB; more is a broken or hostile peer


def channel_key(secret: str) -> bytes:
    return derive(secret, "request-channel")


class EngineUnavailable(Exception):
    """The engine actor died, is restarting, or closed its channel."""


class EngineCallFailed(Exception):
    """The engine's method raised; the message is its exception's."""


class FramedConnection(asyncio.Protocol):
    """One TCP connection carrying lists of messages, after the handshake: messages posted
    during one loop turn leave at its end in one frame; each frame received is decoded
    whole by `decoder` and handed over.

    `on_messages(conn, messages)` per frame; `on_lost(conn)` once, when the connection
    closes for any reason (the peer's process exited, `close()`, a refused handshake).
    `ready` resolves when the handshake is done (or fails with AuthError/EngineUnavailable;
    `refused` then says why, and whoever owns the connection logs it). `gate(conn)`, on the
    listening side: called once the peer's address is known, before anything is sent; a
    reason refuses the connection at once.
    """

    def __init__(self, on_messages: Callable[[FramedConnection, list], None],
                 on_lost: Callable[[FramedConnection], None], decoder: msgspec.msgpack.Decoder,
                 handshake: ServerHandshake | ClientHandshake, name: str,
                 gate: Callable[[FramedConnection], str | None] | None = None):
        self.on_messages, self.on_lost = on_messages, on_lost
        self._decoder, self._handshake, self.name, self._gate = decoder, handshake, name, gate
        self.transport: asyncio.Transport | None = None  # None once closed: posts are dropped
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.refused: str | None = None  # why the handshake refused the peer
        self.peer = self.peer_host = "?"
        self._received = bytearray()  # bytes of frames not complete yet
        self._outbox: list = []  # messages posted this loop turn
        self._deadline: asyncio.TimerHandle | None = None
        self._seal: FrameSeal | None = None  # what this end sends, once the handshake is done
        self._open: FrameSeal | None = None  # what it receives
        self.frames_sent = self.messages_sent = 0  # batched: frames <= messages

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = host_port(*peer[:2]) if peer else "?"
        self.peer_host = peer[0] if peer else "?"
        if self._gate is not None and (why := self._gate(self)) is not None:
            self._refuse(why)
            return
        sock = transport.get_extra_info("socket")
        # A frame is one write: Nagle would hold a small reply back for the peer's ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_S * 1000)
        if isinstance(self._handshake, ServerHandshake):
            transport.write(self._handshake.hello())
        self._deadline = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self._refuse, f"no handshake within {HANDSHAKE_TIMEOUT_S:.0f} s")

    def _refuse(self, reason: str) -> None:
        if self.ready.done() or self.transport is None:
            return
        self.refused = reason
        self.ready.set_exception(AuthError(f"{self.peer}: {reason}"))
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.ready.done():
            try:
                step = self._handshake.feed(data)
            except AuthError as err:
                self._refuse(str(err))
                return
            if step.send:
                self.transport.write(step.send)
            if not step.done:
                return
            self._deadline.cancel()
            self._seal, self._open = FrameSeal(step.session.send), FrameSeal(step.session.recv)
            self.ready.set_result(None)
            data = step.leftover
        buf = self._received
        buf += data
        start = 0
        view = memoryview(buf)
        try:
            while len(buf) - start >= _LENGTH.size:
                (n,) = _LENGTH.unpack_from(buf, start)
                if n > MAX_FRAME_BYTES:
                    raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
                end = start + _LENGTH.size + n
                if len(buf) < end:
                    break
                frame = self._decoder.decode(self._open.open(view[start + _LENGTH.size:end]))
                start = end
                self.on_messages(self, frame)
        except SealError as err:  # someone on the path, or a peer of another session
            log.error("%s: closing the connection with %s: %s", self.name, self.peer, err)
            view.release()
            self.close()
            return
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as err:
            # An authenticated peer sent what this side does not accept: another version, or a bug.
            log.error("%s: closing the connection with %s: a frame does not decode: %s", self.name, self.peer, err)
            view.release()
            self.close()
            return
        view.release()
        del buf[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._deadline is not None:
            self._deadline.cancel()
        if not self.ready.done():
            self.ready.set_exception(EngineUnavailable(f"the connection closed during the handshake: "
                                                       f"{exc or 'closed by the peer'}"))
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
        assert self.ready.done() and self.ready.exception() is None, (
            "a message posted before the handshake ended: the router must await connect()")
        frame = self._seal.seal(_encode(msgs))
        self.transport.writelines([_LENGTH.pack(len(frame)), frame])
        self.frames_sent += 1
        self.messages_sent += len(msgs)
