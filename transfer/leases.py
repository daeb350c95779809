"""P-side leases: which finished prefills' blocks D may still read.

A lease starts when P's scheduler hands a finished request's blocks to the
connector (vLLM then keeps them allocated), and ends when D releases it or when
it expires. Ended leases are reported once by `take_finished()`, after which
vLLM frees the blocks. A lease with a read in progress never ends under the
reader: freeing blocks mid-copy would send D another request's KV.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


class LeaseError(KeyError):
    """No readable lease for that request (never held, released or expired)."""


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group
    expires_at: float  # time.monotonic()
    readers: int = 0
    released: bool = False
    blocks_set: tuple[frozenset[int], ...] = field(init=False)

    def __post_init__(self):
        self.blocks_set = tuple(frozenset(g) for g in self.block_ids)


class LeaseTable:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        # request_id -> Lease; invariant: a lease leaves this dict only via take_finished().
        self._leases: dict[str, Lease] = {}

    def add(self, request_id: str, block_ids: tuple[tuple[int, ...], ...], lease_s: float) -> None:
        with self._cond:
            assert request_id not in self._leases, f"lease for {request_id} added twice: metadata delivered twice?"
            self._leases[request_id] = Lease(request_id, block_ids, self._clock() + lease_s)
            self._cond.notify_all()

    def _ended(self, lease: Lease, now: float) -> bool:
        return lease.released or now >= lease.expires_at

    def acquire(self, request_id: str, wait_s: float) -> Lease:
        """Pin a lease for reading. Waits up to `wait_s` for it to appear: D can
        ask before P's worker has received the lease from P's scheduler."""
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                lease = self._leases.get(request_id)
                now = self._clock()
                if lease is not None:
                    if self._ended(lease, now):
                        raise LeaseError(f"lease of {request_id} already {'released' if lease.released else 'expired'}")
                    lease.readers += 1
                    return lease
                if now >= deadline:
                    raise LeaseError(f"no lease for {request_id}")
                self._cond.wait(deadline - now)

    def unpin(self, lease: Lease) -> None:
        with self._cond:
            assert lease.readers > 0, f"unpin of {lease.request_id} without acquire"
            lease.readers -= 1

    def release(self, request_id: str) -> bool:
        """D is done with it. False if there was no live lease."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None or lease.released:
                return False
            lease.released = True
            return True

    def take_finished(self) -> set[str]:
        """Requests whose lease ended and has no reader: their blocks may be freed now."""
        now = self._clock()
        with self._cond:
            done = {rid for rid, lease in self._leases.items() if self._ended(lease, now) and lease.readers == 0}
            for rid in done:
                del self._leases[rid]
            return done

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)
