"""A request channel's other end in one process, for tests/test_request_channel*.py: an engine
body (`Body`) served on real TCP connections, and a `LocalActor` that stands for its Ray actor
handle, running the body in the same event loop, able to die and restart as Ray's actors do."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorDiedError

from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    PoolOffer,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
)
from pdcluster.transfer.channel_server import ServesRequestChannel
from pdcluster.transfer.network import InstanceAddress
from pdcluster.transfer.request_channel import EngineChannel

SAMPLING = SamplingSpec(max_tokens=3)
SECRET = "test-cluster-secret-0123456789"
LOOPBACK = InstanceAddress("127.0.0.1", "127.0.0.1")


def prefill_req(rid: str = "r0") -> PrefillRequest:
    return PrefillRequest(rid, [1, 2, 3], SAMPLING)


def decode_req(rid: str = "r0", n: int = 3) -> DecodeRequest:
    return DecodeRequest(rid, [1, 2, 3], SamplingSpec(max_tokens=n), None)


class Body(ServesRequestChannel):
    """An engine body: prefill answers at once; decode yields max_tokens one-token deltas,
    or waits forever after the first when `hang_after_first`."""

    def __init__(self, hang_after_first: bool = False, finish: bool = True, fail: bool = False,
                 address: InstanceAddress = LOOPBACK):
        self.hang_after_first, self.finish, self.fail = hang_after_first, finish, fail
        self.cancelled: list[str] = []
        self.prefills = 0
        self.serve_requests_on(address, SECRET)

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        self.prefills += 1
        if self.fail:
            raise ValueError(f"bad prompt for {req.request_id}")
        return PrefillResult(req.request_id, None, len(req.prompt_token_ids), p_cached_tokens=2)

    async def open_pool(self, req: PoolRequest) -> PoolOffer:
        """Offers the prompt's first half (its tier, as it were)."""
        if self.fail:
            raise ValueError(f"no tier for {req.transfer_id}")
        return PoolOffer(req.transfer_id, len(req.prompt_token_ids) // 2)

    async def decode(self, req: DecodeRequest):
        n = req.sampling.max_tokens
        try:
            for i in range(n):
                last = i == n - 1 and self.finish
                yield DecodeDelta([100 + i], finish_reason="length" if last else None)
                if self.hang_after_first:
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise


class _Method:
    def __init__(self, actor: LocalActor, name: str):
        self.actor, self.name = actor, name

    def remote(self, *args):
        return self.actor._invoke(self.name, args)


class LocalActor:
    """What EngineChannel uses of a Ray actor handle, over a body in this process."""

    def __init__(self, body: Body):
        self.body = body
        self._pending: list[asyncio.Future] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    def _invoke(self, name: str, args):
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        task = asyncio.ensure_future(getattr(self.body, name)(*args))
        task.add_done_callback(lambda t: fut.done() or (fut.set_exception(t.exception()) if t.exception()
                                                        else fut.set_result(t.result())))
        return fut

    def die(self, restart_as: Body) -> None:
        """The process dies (its socket with it); pending calls fail; Ray restarts it as `restart_as`."""
        self.body._channel.close()
        for fut in self._pending:
            if not fut.done():
                fut.set_exception(ActorDiedError())
        self.body = restart_as


async def connected(body: Body, secret: str = SECRET) -> tuple[LocalActor, EngineChannel]:
    actor = LocalActor(body)
    return actor, await EngineChannel("decode-0", actor, secret).connect()


async def items(call) -> list:
    out = []
    while (item := await asyncio.wait_for(call.next(), 5)) is not None:
        out.append(item)
        if call.done:
            break
    return out
