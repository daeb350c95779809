"""What a request's lifecycle (router/lifecycle.py) tells its driver to do, and how a call failed.

Commands carry the attempt they belong to: a driver drops one whose attempt has ended
meanwhile (a call that failed at once moved the request on before the rest of its batch ran).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal

from pdcluster.proto.messages import DecodeDelta, DecodeRequest, PoolRequest, PrefillRequest
from pdcluster.router.backend import BackendError, GenerationChunk
from pdcluster.router.openai_models import PdUsage
from pdcluster.router.routing import I, Route

# -- commands: what the driver does


@dataclass(frozen=True)
class Routed(Generic[I]):
    """A new attempt took this route (the driver notes what it needs of it, e.g. P's connection)."""

    attempt: int
    route: Route[I]


@dataclass(frozen=True)
class Prefill(Generic[I]):
    """Send P this prefill; feed its answer to `prefill_answered` or `prefill_failed`."""

    attempt: int
    instance: I
    request: PrefillRequest


@dataclass(frozen=True)
class Decode(Generic[I]):
    """Send D this request; feed each of its outputs to `decode_output` (or `decode_failed`)."""

    attempt: int
    instance: I
    request: DecodeRequest


@dataclass(frozen=True)
class OpenPool(Generic[I]):
    """Ask this P to offer the prompt's run its host tier holds (the pool); feed its answer to
    `pool_opened` or `pool_failed`."""

    attempt: int
    instance: I
    request: PoolRequest


@dataclass(frozen=True)
class CheckLost(Generic[I]):
    """D's load failed before its first token: was P (this attempt's) lost meanwhile? Feed the
    answer to `p_lost`."""

    attempt: int
    instance: I


@dataclass(frozen=True)
class Abort:
    """End this attempt's calls that are still running (P's unless it answered, D's unless it
    finished): the engines abort them."""

    attempt: int


@dataclass(frozen=True)
class Emit:
    """Hand the client these tokens (the last chunk has the finish reason and the counts)."""

    chunk: GenerationChunk


@dataclass(frozen=True)
class Finished:
    """The request is over (`error`: what the client is told); call `close` when done with it."""

    error: BackendError | None = None


Command = Routed | Prefill | OpenPool | Decode | CheckLost | Abort | Emit | Finished

# -- failures: how a call ended without an answer


@dataclass(frozen=True)
class Failure:
    kind: Literal["lost", "timeout", "error"]  # the instance is gone / the deadline passed / it said so
    message: str = ""


# -- the P/D report the client's chunks carry (`usage.pd`)


def pd_so_far(route: Route, p_cached_tokens: int, migrations: int) -> PdUsage:
    """Before D's last output: P's hit (0 until P answers) and the route's kind; D reports its
    hit and the transfer only with its last output."""
    return PdUsage(p_cached_tokens=p_cached_tokens, d_cached_tokens=0, transferred_tokens=0,
                   local_prefill=route.local_prefill, migrations=migrations)


def pd_final(route: Route, p_cached_tokens: int, last: DecodeDelta, migrations: int, p_pool_tokens: int = 0) -> PdUsage:
    """The whole report, from D's last output and its transfer report (and P's pool read's tokens)."""
    t = last.transfer
    return PdUsage(
        p_cached_tokens=p_cached_tokens,
        # D prefilled it: D's own hit is all it had (the engine's count).
        d_cached_tokens=t.d_cached_tokens if t else (last.num_cached_tokens if route.local_prefill else 0),
        transferred_tokens=t.transferred_tokens if t else 0, transfer_error=t.error if t else None,
        # D prefilled it reading a P's tier: what it read is the pool's; else what P read of a peer's.
        pool_tokens=(t.transferred_tokens if t and t.error is None else 0) if route.local_prefill else p_pool_tokens,
        prefill_instance=route.decode.name if route.local_prefill else route.prefill.name,
        local_prefill=route.local_prefill, migrations=migrations)
