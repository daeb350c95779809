"""What the connector's two sides (transfer/connector.py) pass each step: the scheduler side's
orders to the worker (sources' steps and ends on P, loads and cancels on D, in `PdcMetadata`),
the worker's pull timings back (`PullTimings`), and the settings both read from vLLM's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.transfer.grpc_client import LoadJob, PullTiming
from pdcluster.transfer.tier_book import BlockKey
from pdcluster.transfer.tier_scheduler import TierOrders
from pdcluster.transfer.vllm_compat import (  # vLLM's, through the module that knows each version
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class ConnectorSettings:
    """From kv_connector_extra_config (set by cluster/engine_actor.py)."""

    host: str = "127.0.0.1"
    port: int = 0  # P's KV server; 0: any free port
    advertise_host: str | None = None  # address D should dial; default: host
    lease_s: float = 60.0
    timeout_s: float = 30.0
    chunk_bytes: int = 1 << 20
    # Fault injection (tests): break transfers whose id starts with it, and host-tier loads for
    # requests whose id does.
    break_prefix: str | None = None
    channel_backend: str | None = None  # gloo | nccl | hccl: P's pair channels for torch_dist transfers
    encrypt: bool = False  # KV bytes sealed on the gRPC stream (transfer/kv_seal.py)
    host_tier_bytes: int = 0  # the instance's host KV tier (transfer/tier_scheduler.py); 0: none

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass(frozen=True)
class SourceStep:
    """P: this step computes `transfer_id`'s prompt up to `step_tokens`, in these blocks."""

    transfer_id: str
    request_id: str
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group, P's whole block table
    step_tokens: int


@dataclass(frozen=True)
class SourceEnd:
    """P: the request ended; its blocks stay until D releases them or the lease expires."""

    transfer_id: str
    aborted: bool  # P did not finish the prefill: D must not wait for it


@dataclass
class PdcMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    steps: list[SourceStep] = field(default_factory=list)  # P
    ends: list[SourceEnd] = field(default_factory=list)  # P
    preempted: list[str] = field(default_factory=list)  # P: request ids whose blocks P took back
    loads: list[LoadJob] = field(default_factory=list)  # D: what to receive (or only release)
    cancels: list[str] = field(default_factory=list)  # D: request ids whose load must stop
    tier: TierOrders | None = None  # the host tier's copies, carried out before everything above


@dataclass
class PullTimings(KVConnectorWorkerMetadata):
    """Worker -> scheduler: how each finished pull went (for the request's timeline), the host
    tier's blocks the worker found no bytes for (the book forgets them), and the requests whose
    tier load failed (vLLM recomputes those blocks or ends them: the tier gave them nothing)."""

    pulls: dict[str, PullTiming] = field(default_factory=dict)
    tier_lost: tuple[BlockKey, ...] = ()
    tier_failed: tuple[str, ...] = ()
    # D: each request's tier load, (start, end) in time.monotonic_ns (it ran before its pull started)
    tier_loads: dict[str, tuple[int, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PullTimings), f"cannot merge {type(other).__name__} into PullTimings"
        return PullTimings({**self.pulls, **other.pulls}, (*self.tier_lost, *other.tier_lost),
                           (*self.tier_failed, *other.tier_failed), {**self.tier_loads, **other.tier_loads})
