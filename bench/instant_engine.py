"""An engine actor that answers at once: the router's counterpart of an instant fake HTTP backend.

pdcluster's router does not speak HTTP to P and D; it sends its calls over each
engine actor's request channel (transfer/request_channel.py). To measure the router's own overhead (bench/router_overhead.py), it is put in
front of these instead of real engines: the same method names and messages as
`cluster.engine_actor.EngineActor` (proto/messages.py), no model, no KV.

- `prefill` returns a PrefillResult at once, `connector_params=None` (nothing for D to
  pull; the router then sends D no handle, as for a prompt P held no KV for);
- `decode` yields `max_tokens` tokens at once, `tokens_per_delta` per
  DecodeDelta (1: one message per token, as a vLLM engine streams each step),
  the last with finish_reason "length" and empty transfer stats;
- `info`, `clock`, `load`, `health`, `reset_prefix_cache`, `shutdown` as the real one;
- its own, for the benchmark: `decode_in_one_reply` (decode's deltas in one reply,
  one Ray message, for the Ray-calls floor) and `set_tokens_per_delta`.
The generated ids are the prompt's own, so any tokenizer detokenizes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

from pdcluster.proto.engine import Engine
from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    EngineLoad,
    EngineTimes,
    InstanceInfo,
    PoolOffer,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    Role,
    TierCounts,
    TransferStats,
)
from pdcluster.proto.spec import ClusterSpec
from pdcluster.transfer.channel_server import ServesRequestChannel
from pdcluster.transfer.network import instance_address, instance_planes


def instant_prefill(req: PrefillRequest) -> PrefillResult:
    """What `prefill` answers (pure): nothing for D, no hit."""
    return PrefillResult(request_id=req.request_id, connector_params=None, prompt_tokens=len(req.prompt_token_ids),
                         p_cached_tokens=0)


def instant_deltas(req: DecodeRequest, tokens_per_delta: int = 1) -> list[DecodeDelta]:
    """What `decode` yields for `req` (pure): its max_tokens ids in deltas, the last one finished."""
    assert tokens_per_delta >= 1, f"tokens_per_delta {tokens_per_delta}: must be at least 1"
    assert req.prompt_token_ids, "an empty prompt: the router should have refused it"
    n, prompt = req.sampling.max_tokens, req.prompt_token_ids
    ids = [prompt[i % len(prompt)] for i in range(n)]
    if req.sampling.final_only:  # one delta at the end, as EngineActor sends it
        tokens_per_delta = n
    out = []
    for start in range(0, n, tokens_per_delta):
        last = start + tokens_per_delta >= n
        out.append(DecodeDelta(new_token_ids=ids[start:start + tokens_per_delta],
                               finish_reason="length" if last else None,
                               transfer=TransferStats() if last else None,
                               num_cached_tokens=0, engine=EngineTimes() if last else None))
    return out


class InstantEngine(ServesRequestChannel, Engine):
    """Ray actor body (wrapped with ray.remote by the benchmark), with EngineActor's interface."""

    def __init__(self, spec: ClusterSpec, role: Role, index: int, tokens_per_delta: int = 1):
        import ray

        self.spec, self.name, self.role, self.index = spec, f"{role}-{index}", role, index
        self.engine_id = f"{spec.name}-{self.name}"
        self.tokens_per_delta = tokens_per_delta
        self.started = time.time()
        self.address = instance_address(spec.network, ray.util.get_node_ip_address())
        self.serve_requests_on(self.address, spec.secret())

    async def info(self) -> InstanceInfo:
        import ray

        # Its KV-event addresses are advertised (the router follows them) but nothing publishes there.
        planes = instance_planes(self.address, await self.open_channel(),
                                 self.spec.kv_event_ports(self.role, self.index))
        return InstanceInfo(name=self.name, role=self.role, index=self.index,
                            node_ip=ray.util.get_node_ip_address(), pid=os.getpid(), kv_address=None,
                            engine_id=self.engine_id, started_s=0.0, planes=planes)

    def clock(self) -> int:
        return time.monotonic_ns()

    def load(self) -> EngineLoad:
        return EngineLoad(kv_cache_usage=0.0, running=0, waiting=0, steps=0)

    async def health(self) -> bool:
        return True

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return instant_prefill(req)

    async def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeDelta]:
        for delta in instant_deltas(req, self.tokens_per_delta):
            yield delta

    async def open_pool(self, req: PoolRequest) -> PoolOffer:
        return PoolOffer(req.transfer_id, 0)  # no KV, no tier: nothing to offer

    async def tier_counts(self) -> TierCounts | None:
        return None  # no tier

    def set_tokens_per_delta(self, n: int) -> None:
        """Not EngineActor's: how many tokens each DecodeDelta carries from now on."""
        assert n >= 1, f"tokens_per_delta {n}: must be at least 1"
        self.tokens_per_delta = n

    async def decode_in_one_reply(self, req: DecodeRequest) -> list[DecodeDelta]:
        """Not EngineActor's: `decode`'s deltas as one reply, to measure what one Ray message
        per streamed item costs (bench/router_overhead.py's 'Ray calls alone' rows)."""
        return instant_deltas(req, self.tokens_per_delta)

    async def reset_prefix_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.close_channel()
