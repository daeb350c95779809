"""The P/D request path: prefill on a P actor, then decode on a D actor.

`PDDispatcher` implements `TokenBackend` over Ray actor handles. It picks P and D
round-robin, bounds every wait by the request deadline, and turns each failure
into a `BackendError` with a status and a message naming the instance: a dead
actor is 503, a timeout 504, a failed KV transfer 502. Nothing waits forever:
on any exit path the decode stream is cancelled, which aborts it in vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, TaskCancelledError

from pdcluster.cluster.messages import DecodeDelta, DecodeRequest, PrefillRequest, PrefillResult, SamplingSpec
from pdcluster.router.backend import BackendError, GenerationChunk, ModelCard, TokenBackend

log = logging.getLogger(__name__)

_ACTOR_ERRORS = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True)
class Instance:
    name: str  # "prefill-0"
    actor: ray.actor.ActorHandle


class PDDispatcher(TokenBackend):
    def __init__(self, prefill: list[Instance], decode: list[Instance], card: ModelCard, request_timeout_s: float):
        assert prefill and decode, "a P/D cluster needs at least one P and one D instance"
        self.prefill, self.decode = prefill, decode
        self._card = card
        self._timeout_s = request_timeout_s
        self._next_p = itertools.cycle(prefill)
        self._next_d = itertools.cycle(decode)

    def model_card(self) -> ModelCard:
        return self._card

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingSpec) -> AsyncIterator[GenerationChunk]:
        deadline = time.monotonic() + self._timeout_s
        p, d = next(self._next_p), next(self._next_d)
        pre = await self._prefill(p, PrefillRequest(request_id, prompt_token_ids, sampling), deadline)
        stream = d.actor.decode.options(num_returns="streaming").remote(
            DecodeRequest(request_id, prompt_token_ids, sampling, pre.handle))
        finished = False
        try:
            while not finished:
                delta = await self._next_delta(d, stream, deadline)
                if delta is None:
                    raise BackendError(f"decode instance {d.name} ended {request_id} without a finish", 502)
                finished = delta.finish_reason is not None
                yield self._chunk(pre, delta, p, d)
        finally:
            if not finished:
                ray.cancel(stream)  # aborts the request inside D's engine

    async def _prefill(self, p: Instance, req: PrefillRequest, deadline: float) -> PrefillResult:
        ref = p.actor.prefill.remote(req)
        try:
            return await asyncio.wait_for(ref, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise BackendError(f"prefill of {req.request_id} on {p.name} timed out after {self._timeout_s:.0f} s", 504,
                               "timeout") from None
        except _ACTOR_ERRORS as err:
            raise BackendError(f"prefill instance {p.name} is unavailable: {type(err).__name__}", 503,
                               "service_unavailable") from None
        except asyncio.CancelledError:  # client went away mid-prefill: abort it on P too
            ray.cancel(ref)
            raise

    async def _next_delta(self, d: Instance, stream, deadline: float) -> DecodeDelta | None:
        try:
            ref = await asyncio.wait_for(stream.__anext__(), timeout=max(0.0, deadline - time.monotonic()))
            return await ref
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise BackendError(f"decode on {d.name} timed out after {self._timeout_s:.0f} s", 504, "timeout") from None
        except TaskCancelledError:
            raise BackendError(f"decode on {d.name} was cancelled", 503, "service_unavailable") from None
        except _ACTOR_ERRORS as err:
            raise BackendError(f"decode instance {d.name} is unavailable: {type(err).__name__}", 503,
                               "service_unavailable") from None

    @staticmethod
    def _chunk(pre: PrefillResult, delta: DecodeDelta, p: Instance, d: Instance) -> GenerationChunk:
        if delta.finish_reason in ("error", "abort"):
            raise BackendError(f"decode on {d.name} ended with {delta.finish_reason!r}: the KV transfer from "
                               f"{p.name} failed or D aborted the request", 502, "kv_transfer_error")
        t = delta.transfer
        return GenerationChunk(
            new_token_ids=delta.new_token_ids, finish_reason=delta.finish_reason,
            p_cached_tokens=pre.p_cached_tokens,
            d_cached_tokens=t.d_cached_tokens if t else 0,
            transferred_tokens=t.transferred_tokens if t else 0,
            transfer_error=t.error if t else None,
        )

    async def health(self) -> dict[str, bool]:
        async def one(inst: Instance) -> bool:
            try:
                return await asyncio.wait_for(inst.actor.health.remote(), timeout=5.0)
            except Exception:  # dead, restarting, or engine unhealthy
                return False

        insts = self.prefill + self.decode
        return dict(zip([i.name for i in insts], await asyncio.gather(*(one(i) for i in insts))))
