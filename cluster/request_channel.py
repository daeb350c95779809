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

Liveness is Ray's: the router keeps a `channel_closed` call pending on each
actor; when the actor dies that call fails, every call in flight on the channel
fails with `EngineUnavailable`, and the router reopens the channel once Ray has
restarted the actor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from dataclasses import dataclass
from typing import Literal

import zmq
import zmq.asyncio
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

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


# ---------------------------------------------------------------------------------- engine side


class ChannelServer:
    """Serves `Call`s on `handler.prefill` (a coroutine) and `handler.decode` (an async
    generator) in the engine actor's event loop.

    Invariant: every call gets exactly one `done` reply unless it was aborted (the
    router forgot it then); a call's task is in `_tasks` until that reply is queued.
    """

    def __init__(self, handler):
        self.handler = handler
        self.address = ""
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}  # (router identity, call id) -> its task
        self._outbox: dict[bytes, list[Reply]] = {}  # replies not sent yet, per router
        self._closed = asyncio.Event()
        self._recv_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.frames_sent = self.replies_sent = 0  # replies go out batched: frames <= replies

    def open(self, host: str) -> str:
        """Bind on a free port of `host`; return the address routers connect to."""
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what exceeds its high-water mark: never
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{host}")
        self._sock, self.address = sock, f"tcp://{host}:{port}"
        self._loop = asyncio.get_running_loop()
        self._recv_task = self._loop.create_task(self._serve())
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
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._closed.set()

    @property
    def calls_in_flight(self) -> int:
        return len(self._tasks)

    async def _serve(self) -> None:
        while True:
            identity, frame = await self._sock.recv_multipart()
            for msg in decode(frame):
                key = (identity, msg.call_id)
                if isinstance(msg, Call):
                    assert key not in self._tasks, f"call {msg.call_id} twice from one router: its counter reset?"
                    self._tasks[key] = asyncio.create_task(self._run(identity, msg))
                elif (task := self._tasks.pop(key, None)) is not None:  # Abort of a call still running
                    task.cancel()

    async def _run(self, identity: bytes, call: Call) -> None:
        key = (identity, call.call_id)
        try:
            if call.method == "prefill":
                self._put(identity, Reply(call.call_id, await self.handler.prefill(call.request), done=True))
            else:
                async for delta in self.handler.decode(call.request):
                    last = delta.finish_reason is not None
                    self._put(identity, Reply(call.call_id, delta, done=last))
                    if last:
                        return
                self._put(identity, Reply(call.call_id, None, done=True))  # ended without a finish
        except asyncio.CancelledError:
            pass  # aborted: the router no longer waits for it
        except Exception as err:  # the method's failure goes to the caller, as a Ray call's would
            self._put(identity, Reply(call.call_id, None, done=True, error=f"{type(err).__name__}: {err}"))
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]

    def _put(self, identity: bytes, reply: Reply) -> None:
        if not self._outbox:  # the first reply of this loop turn: send them all at its end
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.setdefault(identity, []).append(reply)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        if self._sock is None:
            return
        for identity, replies in outbox.items():
            self._sock.send_multipart([identity, encode(replies)], copy=False)
            self.frames_sent += 1
            self.replies_sent += len(replies)


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
        self._sock: zmq.asyncio.Socket | None = None
        self._down_reason = "not connected yet"
        self._tasks: list[asyncio.Task] = []
        self._stopped = False

    @property
    def connected(self) -> bool:
        return self._sock is not None

    async def connect(self) -> EngineChannel:
        """Open the channel (the actor binds, we connect) and start reading and watching."""
        self.address = await self.actor.open_channel.remote(self.host)
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            sock.setsockopt(opt, 0)
        sock.connect(self.address)
        self._sock = sock
        watch = self.actor.channel_closed.remote()
        self._tasks = [asyncio.create_task(self._read(sock)), asyncio.create_task(self._watch(watch))]
        return self

    def call(self, method: Method, request: PrefillRequest | DecodeRequest) -> PendingCall:
        if self._sock is None:
            raise EngineUnavailable(self._down_reason)
        call = PendingCall(self, next(self._ids))
        self._calls[call.call_id] = call
        self._send(Call(call.call_id, method, request))
        return call

    def close(self) -> None:
        self._stopped = True
        self._down("the router closed the channel")

    def _send(self, msg) -> None:
        self._sock.send(encode([msg]), copy=False)

    def _abort(self, call_id: int) -> None:
        if self._calls.pop(call_id, None) is not None and self._sock is not None:
            self._send(Abort(call_id))

    def _forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            for reply in decode(frame):
                call = self._calls.get(reply.call_id)
                if call is not None:  # else aborted: its late replies are dropped
                    call.replies.put_nowait(reply)

    async def _watch(self, closed_ref) -> None:
        try:
            await closed_ref
            reason = "its engine closed the channel"
        except ACTOR_ERRORS as err:
            reason = type(err).__name__
        except asyncio.CancelledError:
            return
        self._down(reason)
        if not self._stopped:
            self._tasks.append(asyncio.create_task(self._reconnect()))

    def _down(self, reason: str) -> None:
        """Fail every call in flight and refuse new ones until reconnected."""
        self._down_reason = reason
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
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
