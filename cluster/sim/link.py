"""The modelled P -> D link: when a transfer would have ended at full size.

The bytes that really move are the modelled ones / payload_scale, so their own
timing says little. Each chunk D received is replayed at full size through one
link of the cost model's bandwidth, in arrival order: a chunk starts when it
arrived (P had computed it, D had asked) and the link is free, takes its full
bytes / bandwidth, and the last one adds the link's latency. In push mode that
keeps the part of the transfer hidden under P's compute hidden, and exposes the
rest. One link per transfer: concurrent transfers do not share bandwidth here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    latency_s: float
    bytes_per_s: float

    @classmethod
    def of(cls, cost) -> LinkModel:
        """From a cost model's transfer_s (latency + bytes / bandwidth)."""
        latency = cost.transfer_s(0)
        per_gb = cost.transfer_s(1 << 30) - latency
        assert per_gb > 0, "the cost model's transfer_s does not grow with the bytes"
        return cls(latency, (1 << 30) / per_gb)


def modelled_end_ns(start_ns: int, arrivals: Sequence[tuple[int, int]], link: LinkModel) -> int:
    """End of a transfer begun at start_ns whose chunks arrived at (ns, full-size bytes)."""
    free = start_ns
    for at_ns, nbytes in sorted(arrivals):
        free = max(free, at_ns) + int(nbytes / link.bytes_per_s * 1e9)
    return free + int(link.latency_s * 1e9)
