"""Fake engines for unit tests of the P/D request path (router/pd_dispatch.py).

No Ray, no sockets: a `FakeEngine` stands for both an instance's actor handle
(`health.remote`) and its request channel (`call`, as transfer/request_channel.py's
EngineChannel), and each call is a `FakeCall` that plays a script. Aborted calls
are recorded (the `cancelled` fixture: tests/conftest.py imports it). Everything runs
under `asyncio.run`.
"""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    PoolOffer,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TransferStats,
)
from pdcluster.router.backend import BackendError, GenerationChunk, ModelCard
from pdcluster.router.pd_dispatch import Instance, PDDispatcher
from pdcluster.transfer.request_channel import EngineUnavailable

CARD = ModelCard(name="tiny", max_model_len=64, vocab_size=100)
SAMPLING = SamplingSpec(max_tokens=4)
PROMPT = [1, 2, 3, 4, 5]
HANG = object()  # script item: never completes
DIED = EngineUnavailable("ActorDiedError")  # what a call on a dead engine's channel raises


def run(coro):
    return asyncio.run(coro)


class FakeCall:
    """Like request_channel.PendingCall. `next()` plays the script: an item is returned
    (a PrefillResult or a finished delta ends the call), an exception raised, HANG never
    returns; past the script, None. `cancel()` before the end aborts it, recorded in
    `FakeCall.aborted` (the `cancelled` fixture)."""

    aborted: list = []

    def __init__(self, script: list, queued: bool = False):
        """`queued`: the script's items count as arrived together (has_reply until HANG)."""
        self.script, self.pos, self.done, self.queued = list(script), 0, False, queued

    @property
    def has_reply(self) -> bool:
        return self.queued and not self.done and self.pos < len(self.script) and self.script[self.pos] is not HANG

    async def next(self):
        if self.done or self.pos >= len(self.script):
            self.done = True
            return None
        item = self.script[self.pos]
        self.pos += 1
        if item is HANG:
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = not isinstance(item, DecodeDelta) or item.finish_reason is not None
        return item

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            FakeCall.aborted.append(self)


class FakeRef:
    """Awaitable like a Ray ObjectRef (for `health.remote()`): a value or an exception."""

    def __init__(self, outcome):
        self.outcome = outcome

    def __await__(self):
        async def resolve():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return resolve().__await__()


class Method:
    def __init__(self, fn):
        self.remote = fn


class FakeEngine:
    """Records every call. `prefill_outcome`: None (a PrefillResult naming this engine), an
    exception or HANG; `decode_script`: DecodeDeltas, exceptions, HANG; `pool_outcome`: the tokens
    its tier offers, an exception or HANG."""

    def __init__(self, p_cached: int = 0, prefill_outcome=None, decode_script: list | None = None,
                 health_outcome=True, connected: bool = True, decode_queued: bool = False, pool_outcome=0):
        self.p_cached = p_cached
        self.decode_queued = decode_queued
        self.prefill_outcome = prefill_outcome
        self.decode_script = decode_script
        self.connected = connected
        self.prefill_calls: list[PrefillRequest] = []
        self.decode_calls: list[DecodeRequest] = []
        self.prefill_pending: list[FakeCall] = []
        self.decode_pending: list[FakeCall] = []
        self.pool_outcome = pool_outcome
        self.pool_calls: list[PoolRequest] = []
        self.pool_pending: list[FakeCall] = []
        self.health = Method(lambda: FakeRef(health_outcome))

    def call(self, method: str, req) -> FakeCall:
        if not self.connected:
            raise EngineUnavailable("ActorDiedError")
        if method == "prefill":
            self.prefill_calls.append(req)
            outcome = self.prefill_outcome
            if outcome is None:
                outcome = PrefillResult(request_id=req.request_id, connector_params=None,
                                        prompt_tokens=len(req.prompt_token_ids), p_cached_tokens=self.p_cached)
            call = FakeCall([outcome])
            self.prefill_pending.append(call)
        elif method == "open_pool":
            self.pool_calls.append(req)
            outcome = self.pool_outcome
            call = FakeCall([PoolOffer(req.transfer_id, outcome) if isinstance(outcome, int) else outcome])
            self.pool_pending.append(call)
        else:
            self.decode_calls.append(req)
            call = FakeCall(self.decode_script if self.decode_script is not None else default_script(),
                            queued=self.decode_queued)
            self.decode_pending.append(call)
        return call


def default_script() -> list:
    return [DecodeDelta([10]), DecodeDelta([11, 12]),
            DecodeDelta([13], finish_reason="length", transfer=TransferStats(d_cached_tokens=2, transferred_tokens=3))]


@pytest.fixture
def cancelled(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(FakeCall, "aborted", seen)
    return seen


def make(ps: list[FakeEngine], ds: list[FakeEngine], timeout: float = 5.0, mode: str = "pull",
         **kw) -> PDDispatcher:
    prefill = [Instance(f"prefill-{i}", e, f"e-p{i}", f"10.0.0.1:{5000 + i}") for i, e in enumerate(ps)]
    decode = [Instance(f"decode-{i}", e, f"e-d{i}") for i, e in enumerate(ds)]
    return PDDispatcher(prefill, decode, CARD, request_timeout_s=timeout, transfer_mode=mode,
                        channels={i.name: i.actor for i in prefill + decode}, **kw)


async def collect(disp: PDDispatcher, rid: str = "r0") -> list[GenerationChunk]:
    return [c async for c in disp.generate(rid, PROMPT, SAMPLING)]


async def expect_error(disp: PDDispatcher, rid: str = "r0") -> tuple[BackendError, list[GenerationChunk]]:
    got: list[GenerationChunk] = []
    with pytest.raises(BackendError) as ei:
        async for c in disp.generate(rid, PROMPT, SAMPLING):
            got.append(c)
    return ei.value, got


async def until(condition, timeout_s: float = 5.0, what: str = "the condition") -> None:
    """Return once condition() holds, checking at every turn of the event loop; fail after timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.001)


def engine_ids(disp: PDDispatcher, *numbers: int) -> list[str]:
    """The engine request ids (= transfer ids) of the dispatcher's attempts with these numbers,
    counted over every request it sent (router/lifecycle.py: Dispatch.new_id)."""
    return [f"pdc-{disp.core.id_prefix}-{n}" for n in numbers]
