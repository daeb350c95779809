"""The engine contract: what every P or D instance's body does, whatever runs inside it.

Three bodies declare it: `cluster/engine_actor.py` (a real vLLM engine), `cluster/sim/engine.py`
(the simulated engine, in real time) and `bench/instant_engine.py` (no model: the router's own
cost). `tests/test_engine_protocol.py` checks that each defines every method itself, with these
names, parameters and kinds (coroutine, async generator, plain).

Two paths reach a body. Ray calls, for what the launcher and the router ask once or rarely
(`info`, `clock`, `load`, `health`, `refusals`, `tier_counts`, `reset_prefix_cache`, `shutdown`, and
the request channel's `open_channel`); the request channel (transfer/request_channel.py), for the requests themselves
(`prefill`, `decode`, `open_pool`): one authenticated TCP connection per engine, typed messages
(proto/messages.py), nothing pickled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    EngineLoad,
    InstanceInfo,
    PoolOffer,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    RefusalCounts,
    TierCounts,
)


class Engine(Protocol):
    async def info(self) -> InstanceInfo:
        """Who and where the instance is: its role and index, its node, its engine id, every plane's
        address (the request channel opened by then). The launcher's first call; a D warms up
        before answering."""

    def clock(self) -> int:
        """This host's time.monotonic_ns(), the clock the engine's timestamps are on: the router
        measures each instance's offset from it."""

    def load(self) -> EngineLoad:
        """The scheduler's state after its latest step (KV use, running, waiting)."""

    async def health(self) -> bool:
        """True while the engine can serve; raises (or never answers) when it cannot."""

    def refusals(self) -> RefusalCounts:
        """Peers refused since the instance started, per plane, in all its processes (for the
        router's /metrics)."""

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Compute the prompt's KV with one output token, keep it for D under the transfer's name
        (`req.transfer_id`) until D releases it or its lease ends, and answer P's hit and engine
        times (in pull mode, the handle D needs). Cancelled: the request is aborted in the engine."""

    def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeDelta]:
        """Load what the handle names past this instance's own prefix hit (or, with no handle,
        prefill the prompt itself), then stream the output: deltas of new tokens, each token with
        its time, the last with the finish reason, the transfer's report and the engine's times.
        Closed early: the request is aborted in the engine."""

    async def open_pool(self, req: PoolRequest) -> PoolOffer:
        """Offer a peer the run of the prompt's first blocks this instance's host KV tier holds, at
        its KV address under `req.transfer_id` and the transfer's lease, without running a step: the
        tokens the run covers, 0 where there is none (no tier, nothing held, no KV server)."""

    async def tier_counts(self) -> TierCounts | None:
        """Its host KV tier's own counts (held, loaded, stored, served to peers), None without a tier
        (for the router's /metrics, asked when it is scraped)."""

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (what the instance holds is announced as cleared)."""

    def shutdown(self) -> None:
        """Close the request channel and stop the engine."""
