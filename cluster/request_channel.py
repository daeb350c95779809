"""The request path between the router and one engine actor: a ZMQ connection, not Ray calls.

Ray places the engine actors, restarts them and tells the router when one dies;
the per-request traffic (prefill and decode requests, aborts, results and token
deltas) goes over one long-lived connection per engine, as vLLM's API server
talks to its EngineCore. A Ray call cost the router ~1 ms of CPU to submit and
as much to await, and each streamed item another message (bench/README.md,
"The router's own overhead"); here a call is one pickled frame, and everything
an engine has for one router in one event-loop turn goes back in one frame.

Wire: ROUTER socket in the engine (it may serve several routers), DEALER in the
router. Each frame is a pickled list of messages: router -> engine `Call` and
`Abort`; engine -> router `Reply`. Pickle, as Ray uses between the same
processes: the socket binds on the cluster's transfer host and trusts its peers.

Liveness: when the engine's process exits, its end of the TCP connection closes
and every call in flight on the channel fails at once with `EngineUnavailable`
(a ZMQ socket monitor). Ray says so too, more slowly (a second or more after a
kill): the router keeps a `channel_closed` call pending on each actor, which
fails when the actor dies. Either way the router reopens the channel once Ray
has restarted the actor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import zmq
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from zmq.utils.monitor import recv_monitor_message

from pdcluster.cluster.messages import DecodeDelta, DecodeRequest, PrefillRequest, PrefillResult

log = logging.getLogger(__name__)

Method = Literal["prefill", "decode"]
ACTOR_ERRORS = (ActorDiedError, ActorUnavailableError, RayActorError)  # what a call to a dead actor raises


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


class EngineUnavailable(Exception):
    """The engine actor died, is restarting, or closed its channel."""


class EngineCallFailed(Exception):
    """The engine's method raised; the message is its exception's."""


class MessageSocket:
    """A non-blocking ZMQ socket driven by the event loop: messages posted during one loop
    turn leave at its end, one frame per peer; frames are read when the loop sees the
    socket readable. (zmq.asyncio's future per send and per receive cost the router more
    than the rest of the channel, bench/README.md.)

    Frames are `[*prefix, pickled list of messages]`: the prefix is the peer's identity on
    a ROUTER socket, empty on a DEALER.
    """

    def __init__(self, sock: zmq.Socket, on_messages: Callable[[tuple[bytes, ...], list], None],
                 on_disconnected: Callable[[], None] | None = None):
        """`on_disconnected`: called when a connection of the socket closes (its peer's
        process exited), at once, where Ray's word that an actor died takes a second or more."""
        for opt in (zmq.SNDHWM, zmq.RCVHWM):  # a ROUTER drops what exceeds its high-water mark: never
            sock.setsockopt(opt, 0)
        sock.setsockopt(zmq.LINGER, 0)
        self.sock: zmq.Socket | None = sock
        self.on_messages = on_messages
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._monitor: zmq.Socket | None = None
        if on_disconnected is not None:
            self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._read_monitor, on_disconnected)
        self._outbox: dict[tuple[bytes, ...], list] = {}  # prefix -> messages not sent yet
        self.frames_sent = self.messages_sent = 0  # batched: frames <= messages
        # Arm both FDs: ZMQ signals an FD only after a read of its socket found nothing.
        self._drain()
        if on_disconnected is not None:
            self._read_monitor(on_disconnected)

    def post(self, msg, prefix: tuple[bytes, ...] = ()) -> None:
        if not self._outbox:  # the first of this loop turn: send them all at its end
            self._loop.call_soon(self._flush)
        self._outbox.setdefault(prefix, []).append(msg)

    def close(self) -> None:
        if self._monitor is not None:
            self._loop.remove_reader(self._monitor.getsockopt(zmq.FD))
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self.sock is not None:
            self._loop.remove_reader(self._fd)
            self.sock.close(linger=0)
            self.sock = None

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        if self.sock is None:
            return
        for prefix, msgs in outbox.items():
            self.sock.send_multipart([*prefix, encode(msgs)], flags=zmq.NOBLOCK, copy=False)
            self.frames_sent += 1
            self.messages_sent += len(msgs)
        self._drain()  # a send may have taken the FD's (edge-triggered) readable signal

    def _drain(self) -> None:
        while self.sock is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            parts = self.sock.recv_multipart(zmq.NOBLOCK)
            self.on_messages(tuple(parts[:-1]), decode(parts[-1]))

    def _read_monitor(self, on_disconnected: Callable[[], None]) -> None:
        disconnected = False
        while self._monitor is not None and self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            disconnected |= event["event"] == zmq.EVENT_DISCONNECTED
        if disconnected:
            on_disconnected()


# ---------------------------------------------------------------------------------- engine side


class ChannelServer:
    """Serves `Call`s on `handler.prefill` (a coroutine) and `handler.decode` (an async
    generator) in the engine actor's event loop.

    Invariant: every call gets exactly one `done` reply unless it was aborted (the
    router forgot it then); a call's task is in `_tasks` until that reply is posted.
    """

    def __init__(self, handler):
        self.handler = handler
        self.address = ""
        self.socket: MessageSocket | None = None
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}  # (router identity, call id) -> its task
        self._closed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, host: str) -> str:
        """Bind on a free port of `host`; return the address routers connect to."""
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = sock.bind_to_random_port(f"tcp://{host}")
        self.socket, self.address = MessageSocket(sock, self._on_messages), f"tcp://{host}:{port}"
        self._loop = asyncio.get_running_loop()
        return self.address

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def close_threadsafe(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)

    def close(self) -> None:
        """Cancel every call and close the socket (the engine is shutting down). In the loop's thread."""
        for task in self._tasks.values():
            task.cancel()
        if self.socket is not None:
            self.socket.close()
        self._closed.set()

    @property
    def calls_in_flight(self) -> int:
        return len(self._tasks)

    def _on_messages(self, prefix: tuple[bytes, ...], msgs: list) -> None:
        (identity,) = prefix
        for msg in msgs:
            key = (identity, msg.call_id)
            if isinstance(msg, Call):
                assert key not in self._tasks, f"call {msg.call_id} twice from one router: its counter reset?"
                self._tasks[key] = self._loop.create_task(self._run(identity, msg))
            elif (task := self._tasks.pop(key, None)) is not None:  # Abort of a call still running
                task.cancel()

    async def _run(self, identity: bytes, call: Call) -> None:
        key, reply_to = (identity, call.call_id), (identity,)
        post = self.socket.post
        try:
            if call.method == "prefill":
                post(Reply(call.call_id, await self.handler.prefill(call.request), done=True), reply_to)
            else:
                async for delta in self.handler.decode(call.request):
                    last = delta.finish_reason is not None
                    post(Reply(call.call_id, delta, done=last), reply_to)
                    if last:
                        return
                post(Reply(call.call_id, None, done=True), reply_to)  # ended without a finish
        except asyncio.CancelledError:
            pass  # aborted: the router no longer waits for it
        except Exception as err:  # the method's failure goes to the caller, as a Ray call's would
            post(Reply(call.call_id, None, done=True, error=f"{type(err).__name__}: {err}"), reply_to)
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]


class ServesRequestChannel:
    """Mixin for an engine actor body with `prefill` and `decode`: the two Ray methods
    the router uses to open and watch its request channel."""

    _channel: ChannelServer | None = None

    async def open_channel(self, host: str) -> str:
        """Start serving requests (once; later calls return the same address)."""
        if self._channel is None:
            self._channel = ChannelServer(self)
            self._channel.open(host)
        return self._channel.address

    async def channel_closed(self) -> None:
        """Returns when the channel closes; fails (in the caller) when this actor dies."""
        assert self._channel is not None, "open_channel first"
        await self._channel.wait_closed()

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close_threadsafe()


# ---------------------------------------------------------------------------------- router side


class PendingCall:
    """One call in flight: its replies in order, or the error that ended the channel."""

    def __init__(self, channel: EngineChannel, call_id: int):
        self.channel, self.call_id = channel, call_id
        self.replies: asyncio.Queue[Reply | BaseException] = asyncio.Queue()
        self.done = False

    async def next(self) -> PrefillResult | DecodeDelta | None:
        """The call's next item; None once it ended without one (decode without a finish).
        Raises EngineUnavailable or EngineCallFailed."""
        if self.done:
            return None
        reply = await self.replies.get()
        if isinstance(reply, BaseException):
            self.done = True
            raise reply
        if reply.done:
            self.done = True
            self.channel._forget(self.call_id)
        if reply.error is not None:
            raise EngineCallFailed(reply.error)
        return reply.item

    def cancel(self) -> None:
        """Abort the call in the engine, unless it already ended."""
        if not self.done:
            self.done = True
            self.channel._abort(self.call_id)


class EngineChannel:
    """The router's end of one engine's request channel.

    `call()` sends at once and returns a PendingCall; one reader task routes the
    engine's replies to their calls. While the channel is down (the actor died and
    is restarting), calls fail at once with EngineUnavailable.
    """

    def __init__(self, name: str, actor, host: str):
        self.name, self.actor, self.host = name, actor, host
        self.address = ""
        self._ids = itertools.count()
        self._calls: dict[int, PendingCall] = {}
        self._socket: MessageSocket | None = None
        self._down_reason = "not connected yet"
        self._tasks: list[asyncio.Task] = []
        self._stopped = False

    @property
    def connected(self) -> bool:
        return self._socket is not None

    async def connect(self) -> EngineChannel:
        """Open the channel (the actor binds, we connect) and start watching the actor."""
        self.address = await self.actor.open_channel.remote(self.host)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(self.address)
        self._socket = MessageSocket(sock, self._on_replies, on_disconnected=self._on_disconnected)
        self._tasks = [asyncio.create_task(self._watch(self.actor.channel_closed.remote()))]
        return self

    def call(self, method: Method, request: PrefillRequest | DecodeRequest) -> PendingCall:
        if self._socket is None:
            raise EngineUnavailable(self._down_reason)
        call = PendingCall(self, next(self._ids))
        self._calls[call.call_id] = call
        self._socket.post(Call(call.call_id, method, request))
        return call

    def close(self) -> None:
        self._stopped = True
        self._down("the router closed the channel")

    def _abort(self, call_id: int) -> None:
        if self._calls.pop(call_id, None) is not None and self._socket is not None:
            self._socket.post(Abort(call_id))

    def _forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    def _on_replies(self, prefix: tuple[bytes, ...], replies: list[Reply]) -> None:
        for reply in replies:
            call = self._calls.get(reply.call_id)
            if call is not None:  # else aborted: its late replies are dropped
                call.replies.put_nowait(reply)

    def _on_disconnected(self) -> None:
        """The engine's end of the connection closed: its process is gone (Ray will say so,
        a second or more later) or it closed the channel. Fail its calls now."""
        self._lost("its connection closed (the engine process exited)")

    async def _watch(self, closed_ref) -> None:
        try:
            await closed_ref
            reason = "its engine closed the channel"
        except ACTOR_ERRORS as err:
            reason = type(err).__name__
        except asyncio.CancelledError:
            return
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        """The engine went away: go down, then reopen the channel unless the router closed it."""
        self._down(reason)
        if not self._stopped:
            self._tasks.append(asyncio.create_task(self._reconnect()))

    def _down(self, reason: str) -> None:
        """Fail every call in flight and refuse new ones until reconnected."""
        self._down_reason = reason
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.replies.put_nowait(EngineUnavailable(reason))
        running = asyncio.current_task() if _in_loop() else None
        for task in self._tasks:
            if task is not running:
                task.cancel()

    async def _reconnect(self) -> None:
        """Ray restarts a dead engine actor (max_restarts=-1): reopen the channel on the new one."""
        while not self._stopped:
            try:
                await self.connect()
                log.info("request channel to %s reopened at %s", self.name, self.address)
                return
            except ACTOR_ERRORS as err:
                self._down_reason = f"{type(err).__name__} (restarting)"
                await asyncio.sleep(1.0)


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
