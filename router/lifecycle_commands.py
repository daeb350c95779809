"""What a request's lifecycle (router/lifecycle.py) tells its driver to do, and how a call failed.

Commands carry the attempt they belong to: a driver drops one whose attempt has ended
meanwhile (a call that failed at once moved the request on before the rest of its batch ran).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal

from pdcluster.proto.messages import DecodeRequest, PrefillRequest
from pdcluster.router.backend import BackendError, GenerationChunk
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


Command = Routed | Prefill | Decode | CheckLost | Abort | Emit | Finished

# -- failures: how a call ended without an answer


@dataclass(frozen=True)
class Failure:
    kind: Literal["lost", "timeout", "error"]  # the instance is gone / the deadline passed / it said so
    message: str = ""
