"""What every request's lifecycle (router/lifecycle.py) shares within one router process: the
picker, the transfer settings, admission, the requests in flight, and the engine ids it makes."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic

from pdcluster.proto.router_spec import DEFAULT_MIGRATION_LIMIT
from pdcluster.router.admission import AdmissionLimits, Rejection, admit
from pdcluster.router.routing import I, InstancePicker
from pdcluster.router.timeline import ClockOffset

SAME_CLOCK = ClockOffset(0, 0)


@dataclass
class Dispatch(Generic[I]):
    """What every request's lifecycle shares: the picker, the transfer settings, admission."""

    picker: InstancePicker[I]
    transfer_mode: str = "pull"  # push | pull (from the next request on)
    transport: str = "grpc"  # grpc | torch_dist: named in every handle
    request_timeout_s: float = 600.0  # for the timeouts' messages (the driver keeps the deadline)
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    admission: AdmissionLimits | None = None
    clock_of: Callable[[str], ClockOffset] = lambda name: SAME_CLOCK  # an instance's clock offset
    in_flight: int = 0  # requests taken in and not closed
    fault_prefix: str | None = None  # transfer.break_transfers_with_prefix (tests): see new_id
    # This router process's part of every engine request and transfer id: unique across router
    # processes and restarts, never the client's (X-Request-Id), so no client names engine state.
    id_prefix: str = field(default_factory=lambda: secrets.token_hex(6))
    _id_seq: itertools.count = field(default_factory=itertools.count)

    def admit(self) -> Rejection | None:
        """Whether a request arriving now is refused (a 429), before anything is spent on it."""
        if self.admission is None:
            return None
        return admit(self.admission, self.in_flight, self.picker.least_queued_s())

    def new_id(self, request_id: str) -> str:
        """A fresh name for one attempt of `request_id` on the engines (its request id on P and D,
        its transfer's id); a fault-injected request's has the prefix in front: P breaks it."""
        own = f"pdc-{self.id_prefix}-{next(self._id_seq)}"
        return self.fault_prefix + own if self.fault_prefix and request_id.startswith(self.fault_prefix) else own
