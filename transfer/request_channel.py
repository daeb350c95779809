"""The request path between the router and one engine actor: a TCP connection, not Ray calls.
This module is the router's end; the engine's is transfer/channel_server.py.

Ray places the engine actors, restarts them and tells the router when one dies;
the per-request traffic (prefill and decode requests, aborts, results and token
deltas) goes over one long-lived connection per engine, as vLLM's API server
talks to its EngineCore. A Ray call cost the router ~1 ms of CPU to submit and
as much to await, and each streamed item another message (bench/README.md,
"The router's own overhead"); here a call is one msgpack frame, and everything
a side has for the other in one event-loop turn goes in one frame.

Wire (transfer/channel_wire.py): the engine listens on its node's address, the
router connects, both prove they hold the cluster secret, then typed msgpack frames.

Liveness: when the engine's process exits, the kernel closes its end of the
connection and every call in flight on the channel fails at once with
`EngineUnavailable`. A host that vanishes sends no FIN: TCP keepalive and
TCP_USER_TIMEOUT end the connection within DEAD_PEER_S. Ray says so too, more slowly
(a second or more after a kill; for a lost host, once Ray declares its node dead): the
router keeps a `channel_closed` call pending on each actor, which fails when the actor
dies. Either way the router reopens the channel once Ray has restarted the actor. When
a router's connection closes, the engine aborts that router's calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from pdcluster.proto.messages import DecodeDelta, DecodeRequest, PoolOffer, PoolRequest, PrefillRequest, PrefillResult
from pdcluster.transfer.auth import AuthError, ClientHandshake
from pdcluster.transfer.channel_wire import (
    CALLS,
    ROUTER_INBOX,
    Abort,
    EngineCallFailed,
    EngineUnavailable,
    FramedConnection,
    Method,
    Reply,
    channel_key,
)

log = logging.getLogger(__name__)

ACTOR_ERRORS = (ActorDiedError, ActorUnavailableError, RayActorError)  # what a call to a dead actor raises
CONNECT_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------- router side


class PendingCall:
    """One call in flight: its replies in order, or the error that ended the channel."""

    def __init__(self, channel: EngineChannel, call_id: int):
        self.channel, self.call_id = channel, call_id
        self.replies: asyncio.Queue[Reply | BaseException] = asyncio.Queue()
        self.done = False
        self._back: PrefillResult | DecodeDelta | PoolOffer | None = None  # push_back's item

    async def next(self) -> PrefillResult | DecodeDelta | PoolOffer | None:
        """The call's next item; None once it ended without one (decode without a finish).
        Raises EngineUnavailable or EngineCallFailed."""
        if self._back is not None:
            item, self._back = self._back, None
            return item
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

    @property
    def has_reply(self) -> bool:
        """A reply (or the channel's error) is here: `next()` returns without waiting."""
        return self._back is not None or not self.done and not self.replies.empty()

    def push_back(self, item: PrefillResult | DecodeDelta | PoolOffer) -> None:
        """Put back the item `next()` just gave: the next `next()` gives it again."""
        assert self._back is None, "one item at a time"
        self._back = item

    def cancel(self) -> None:
        """Abort the call in the engine, unless it already ended."""
        if not self.done:
            self.done = True
            self.channel._abort(self.call_id)


class EngineChannel:
    """The router's end of one engine's request channel.

    `call()` sends at the end of the loop turn and returns a PendingCall; the
    connection hands each of the engine's replies to its call. While the channel is
    down (the actor died and is restarting), calls fail at once with EngineUnavailable.
    """

    def __init__(self, name: str, actor, secret: str, before_up: Callable[[], Awaitable[None]] | None = None):
        """`before_up`: awaited on every (re)connection before the channel takes calls (the
        router refreshes what it knows of the instance there: a restarted actor may be on
        another node, at other addresses); if it fails, the connection does too."""
        self.name, self.actor = name, actor
        self._before_up = before_up
        self._key = channel_key(secret)
        self.address = ""
        self._ids = itertools.count()
        self._calls: dict[int, PendingCall] = {}
        self._conn: FramedConnection | None = None
        self._down_reason = "not connected yet"
        # Connections made so far: a change means the instance went away and came back (a new
        # process: whatever the old one held, leases and KV, is gone).
        self.connections = 0
        self._tasks: list[asyncio.Task] = []
        self._stopped = False

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def connect(self) -> EngineChannel:
        """Open the channel (the actor listens, we connect and both prove the secret), and
        start watching the actor."""
        self.address = await self.actor.open_channel.remote()
        host, _, port = self.address.rpartition(":")
        conn = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):  # an unanswered SYN would wait minutes
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: FramedConnection(self._on_replies, self._on_connection_lost, ROUTER_INBOX,
                                             ClientHandshake(self._key), f"request channel to {self.name}"),
                    host.strip("[]"), int(port))
                await conn.ready
        except (OSError, AuthError, EngineUnavailable) as err:  # refused, unreachable, timed out, not ours
            if conn is not None:
                conn.close()
            raise EngineUnavailable(f"cannot connect to {self.name}'s request channel at {self.address}: "
                                    f"{err or type(err).__name__}") from None
        if self._before_up is not None:
            try:
                await self._before_up()
            except BaseException:
                conn.close()
                raise
        if self._stopped:  # closed while connecting
            conn.close()
            raise EngineUnavailable(self._down_reason)
        self._conn = conn
        self.connections += 1
        self._tasks = [asyncio.create_task(self._watch(self.actor.channel_closed.remote()))]
        return self

    def call(self, method: Method, request: PrefillRequest | DecodeRequest | PoolRequest) -> PendingCall:
        if self._conn is None:
            raise EngineUnavailable(self._down_reason)
        call = PendingCall(self, next(self._ids))
        self._calls[call.call_id] = call
        self._conn.post(CALLS[method](call.call_id, request))
        return call

    def close(self) -> None:
        self._stopped = True
        self._down("the router closed the channel")

    def _abort(self, call_id: int) -> None:
        if self._calls.pop(call_id, None) is not None and self._conn is not None:
            self._conn.post(Abort(call_id))

    def _forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    def _on_replies(self, conn: FramedConnection, replies: list[Reply]) -> None:
        for reply in replies:
            call = self._calls.get(reply.call_id)
            if call is not None:  # else aborted: its late replies are dropped
                call.replies.put_nowait(reply)

    def _on_connection_lost(self, conn: FramedConnection) -> None:
        """The engine's end of the connection closed: its process is gone (Ray will say so,
        a second or more later) or it closed the channel. Fail its calls now."""
        if conn is self._conn:  # else _down closed it
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
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
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
            except EngineUnavailable as err:  # the restarted actor died again before we connected
                self._down_reason = str(err)
                await asyncio.sleep(1.0)
            except Exception as err:  # e.g. before_up failed: stay down, and keep trying
                log.exception("reopening the request channel to %s failed", self.name)
                self._down_reason = f"reopening failed: {err}"
                await asyncio.sleep(1.0)


def _in_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
