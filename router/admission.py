"""Whether the router takes a request in, or answers 429 at once (admission control).

vLLM and SGLang bound their queues and answer overload quickly instead of letting a request
time out after minutes; here the router does, before a request costs an engine anything.
Two bounds (spec field `router.admission`), checked in order when a request arrives:
- `max_in_flight`: requests this router process has accepted and not finished (default: two
  per decode slot, 2 x the sum of D's `max_num_seqs`: beyond that a request waits in D's queue
  for a whole generation to end before it even starts);
- `max_queue_s`: the predicted prefill time already queued on the least-loaded P
  (router/prefill_cost.py, the same prediction `prefix_aware` routes by), over which even the
  best P would start this request too late (default: half of `router.request_timeout_s`: a
  request queued that long is more likely than not to time out anyway).

A refused request gets HTTP 429 with `Retry-After` (seconds) and an OpenAI-style error body;
accepted requests are unaffected. With several router processes each bounds its own requests.
A pure function of what the router knows, unit-tested without engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pdcluster.proto.router_spec import AdmissionSpec

RejectReason = Literal["in_flight", "queue"]


@dataclass(frozen=True)
class AdmissionLimits:
    """AdmissionSpec with its defaults settled for one cluster."""

    max_in_flight: int
    max_queue_s: float

    @classmethod
    def settle(cls, spec: AdmissionSpec, decode_slots: int, request_timeout_s: float) -> AdmissionLimits:
        """`decode_slots`: the sum of every D's max_num_seqs."""
        assert decode_slots > 0, "a cluster without decode slots admits nothing: a spec the validators missed"
        return cls(spec.max_in_flight or 2 * decode_slots, spec.max_queue_s or request_timeout_s / 2)


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    message: str
    retry_after_s: int  # whole seconds, as the Retry-After header carries them


def admit(limits: AdmissionLimits, in_flight: int, least_queued_s: float) -> Rejection | None:
    """None: take it in. `in_flight`: requests accepted and not finished, this one excluded;
    `least_queued_s`: the predicted prefill time queued on the least-loaded live P."""
    if in_flight >= limits.max_in_flight:
        return Rejection("in_flight", f"the server is at its limit of {limits.max_in_flight} requests in flight; "
                                      "retry later", 1)
    if least_queued_s > limits.max_queue_s:
        wait = least_queued_s - limits.max_queue_s  # until the best P's queue is back under the bound
        return Rejection("queue", f"every prefill instance has over {limits.max_queue_s:.0f} s of prefill queued "
                                  f"(the least {least_queued_s:.0f} s); retry later", max(1, math.ceil(wait)))
    return None
