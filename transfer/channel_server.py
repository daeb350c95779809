"""The engine's end of the request channel: it listens, admits routers that prove the cluster
secret, and runs their calls on the engine body (transfer/request_channel.py says what the channel
is, and holds the router's end)."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

from pdcluster.proto.messages import RefusalCounts
from pdcluster.transfer import refusal_counts
from pdcluster.transfer.auth import Refusals
from pdcluster.transfer.channel_wire import (
    ENGINE_INBOX,
    Abort,
    DecodeCall,
    DecodeReply,
    FramedConnection,
    PoolCall,
    PoolReply,
    PrefillCall,
    PrefillReply,
    ServerHandshake,
    channel_key,
)
from pdcluster.transfer.network import InstanceAddress, host_port


class ChannelServer:
    """Serves calls on `handler.prefill` and `handler.open_pool` (coroutines) and `handler.decode`
    (an async generator) in the engine actor's event loop, for every router connected that proved
    it holds the cluster secret (`refused` counts those that did not).

    A connection that has not proved itself yet costs a socket and a timer: at most
    MAX_PENDING of them at once, MAX_PENDING_PER_HOST from one address (past that, a new one
    is closed at once), each for HANDSHAKE_TIMEOUT_S at most; refusals are logged at a bounded
    rate. A flood of silent peers from one host thus delays no router on another.

    Invariant: every call gets exactly one `done` reply unless it was aborted (the
    router forgot it, or its connection closed); a call's task is in `_tasks` until
    that reply is posted.
    """

    MAX_PENDING = 64
    MAX_PENDING_PER_HOST = 16  # a host runs a few routers, each opening one connection at a time

    def __init__(self, handler, secret: str, name: str = "request channel"):
        self.handler, self.name = handler, name
        self._key = channel_key(secret)
        self.address = ""  # "host:port", as advertised
        self.connections: set[FramedConnection] = set()  # one per router, once it proved itself
        self.refused = 0  # connections refused at the handshake
        self._refusals = Refusals(name, "connection(s)", "request_channel")
        # Connections in their handshake -> their peer's host; `_pending_per_host` counts them per host.
        self._pending: dict[FramedConnection, str] = {}
        self._pending_per_host: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._tasks: dict[tuple[FramedConnection, int], asyncio.Task] = {}  # (router's connection, call id) -> task
        self._closed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self, address: InstanceAddress) -> str:
        """Listen on a free port of `address.bind`; return the address routers connect to
        (`address.advertise` and that port). The address is set, and connections are queued,
        before the first await."""
        sock = socket.create_server((address.bind, 0))
        self.address = host_port(address.advertise, sock.getsockname()[1])
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(self._accept, sock=sock)
        return self.address

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def close_threadsafe(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    def close(self) -> None:
        """Cancel every call and close every connection (the engine is shutting down). In the loop's thread."""
        for task in self._tasks.values():
            task.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        self._closed.set()

    @property
    def calls_in_flight(self) -> int:
        return len(self._tasks)

    def _accept(self) -> FramedConnection:
        conn = FramedConnection(self._on_messages, self._on_lost, ENGINE_INBOX, ServerHandshake(self._key), self.name,
                                gate=self._gate)
        conn.ready.add_done_callback(lambda ready: self._admit(conn, ready))
        return conn

    def _gate(self, conn: FramedConnection) -> str | None:
        host = conn.peer_host
        if len(self._pending) >= self.MAX_PENDING:
            return f"{self.MAX_PENDING} handshakes pending already"
        if self._pending_per_host[host] >= self.MAX_PENDING_PER_HOST:
            return f"{self.MAX_PENDING_PER_HOST} handshakes pending from {host} already"
        self._pending[conn] = host
        self._pending_per_host[host] += 1
        return None

    def _admit(self, conn: FramedConnection, ready: asyncio.Future) -> None:
        if (host := self._pending.pop(conn, None)) is not None:
            self._pending_per_host[host] -= 1
            if not self._pending_per_host[host]:
                del self._pending_per_host[host]
        if ready.exception() is None:
            self.connections.add(conn)
        elif conn.refused is not None:
            self.refused += 1
            self._refusals.refused(conn.peer, conn.refused)

    def _on_lost(self, conn: FramedConnection) -> None:
        """The router went away: nobody waits for its calls any more."""
        self.connections.discard(conn)
        for key in [k for k in self._tasks if k[0] is conn]:
            self._tasks.pop(key).cancel()

    def _on_messages(self, conn: FramedConnection, msgs: list) -> None:
        for msg in msgs:
            key = (conn, msg.call_id)
            if not isinstance(msg, Abort):
                assert key not in self._tasks, f"call {msg.call_id} twice from one router: its counter reset?"
                self._tasks[key] = self._loop.create_task(self._run(conn, msg))
            elif (task := self._tasks.pop(key, None)) is not None:  # Abort of a call still running
                task.cancel()

    async def _run(self, conn: FramedConnection, call: PrefillCall | DecodeCall | PoolCall) -> None:
        key, post = (conn, call.call_id), conn.post
        reply = {PrefillCall: PrefillReply, DecodeCall: DecodeReply, PoolCall: PoolReply}[type(call)]
        try:
            if isinstance(call, PrefillCall):
                post(PrefillReply(call.call_id, await self.handler.prefill(call.request), done=True))
            elif isinstance(call, PoolCall):
                post(PoolReply(call.call_id, await self.handler.open_pool(call.request), done=True))
            else:
                async for delta in self.handler.decode(call.request):
                    last = delta.finish_reason is not None
                    post(DecodeReply(call.call_id, delta, done=last))
                    if last:
                        return
                post(DecodeReply(call.call_id, None, done=True))  # ended without a finish
        except asyncio.CancelledError:
            pass  # aborted: the router no longer waits for it
        except Exception as err:  # the method's failure goes to the caller, as a Ray call's would
            post(reply(call.call_id, None, done=True, error=f"{type(err).__name__}: {err}"))
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]


class ServesRequestChannel:
    """Mixin for an engine actor body with `prefill` and `decode`: the two Ray methods
    the router uses to open and watch its request channel. The body calls
    `serve_requests_on(address, secret)` in its __init__."""

    _channel: ChannelServer | None = None
    _channel_address: InstanceAddress | None = None
    _channel_secret: str | None = None

    def serve_requests_on(self, address: InstanceAddress, secret: str) -> None:
        """Before the body starts its engine: the engine's processes count their refusals into
        one file with this one's (refusal_counts.py)."""
        self._channel_address, self._channel_secret = address, secret
        refusal_counts.share()

    def refusals(self) -> RefusalCounts:
        """Peers this instance refused since it started, per plane (all its processes)."""
        return refusal_counts.read()

    async def open_channel(self) -> str:
        """Start serving requests (once; later calls return the same address)."""
        if self._channel is None:
            assert self._channel_address is not None and self._channel_secret is not None, (
                "serve_requests_on(address, secret) was not called in the engine body's __init__")
            self._channel = ChannelServer(self, self._channel_secret,
                                          f"request channel of {getattr(self, 'name', type(self).__name__)}")
            # A call meanwhile gets the address: it already queues connections.
            await self._channel.open(self._channel_address)
        return self._channel.address

    async def channel_closed(self) -> None:
        """Returns when the channel closes; fails (in the caller) when this actor dies."""
        assert self._channel is not None, "open_channel first"
        await self._channel.wait_closed()

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close_threadsafe()
