"""When D prefills a request itself (router/local_prefill.py), on hand-made views."""

from __future__ import annotations

import pytest

from pdcluster.proto.router_spec import LocalPrefillSpec
from pdcluster.router.local_prefill import LocalView, decide

ON = LocalPrefillSpec(policy="short_remainder", max_tokens=512, max_in_flight=2)


def view(prompt: int = 4096, d_matched: int = 3584, stale: bool = False, in_flight: int = 0,
         p_queued_s: float = 0.0) -> LocalView:
    return LocalView(prompt, d_matched, stale, in_flight, p_queued_s)


@pytest.mark.parametrize("d_matched, local, reason", [
    (3584, True, "short_remainder"),  # exactly max_tokens left: D
    (3583, False, "long_remainder"),  # one more: P
    (4096, True, "short_remainder"),
    (0, False, "long_remainder"),
])
def test_the_threshold_is_inclusive_and_exact(d_matched, local, reason):
    d = decide(ON, view(d_matched=d_matched))
    assert (d.local, d.reason, d.remainder_tokens) == (local, reason, 4096 - d_matched)


def test_a_short_cold_prompt_is_a_short_remainder_too():
    assert decide(ON, view(prompt=300, d_matched=0)).local


def test_never_keeps_every_prefill_on_p():
    never = LocalPrefillSpec(policy="never", max_tokens=100_000)
    assert (decide(never, view(d_matched=4096)).local, decide(never, view()).reason) == (False, "never")


def test_a_busy_d_sends_the_request_to_p():
    assert decide(ON, view(in_flight=1)).local
    d = decide(ON, view(in_flight=2))
    assert (d.local, d.reason) == (False, "d_busy")


def test_a_stale_index_is_never_trusted_for_a_hit():
    # The index lost events: what it says D holds may be wrong, so no local prefill on it.
    d = decide(ON, view(d_matched=4096, stale=True))
    assert (d.local, d.reason) == (False, "stale_index")


def test_a_busy_p_lets_d_prefill_a_long_remainder_unless_d_is_busy_too():
    busy = ON.model_copy(update={"p_busy_s": 5.0})
    assert decide(busy, view(d_matched=0, p_queued_s=4.9)).reason == "long_remainder"
    d = decide(busy, view(d_matched=0, p_queued_s=5.0))
    assert (d.local, d.reason) == (True, "p_busy")
    assert decide(busy, view(d_matched=0, p_queued_s=9.0, in_flight=2)).reason == "d_busy"
    # A short remainder is a short remainder, busy P or not.
    assert decide(busy, view(p_queued_s=9.0)).reason == "short_remainder"


def test_off_by_default_and_every_field_checked():
    assert LocalPrefillSpec().policy == "never"
    with pytest.raises(ValueError, match="max_in_flight"):
        LocalPrefillSpec(max_in_flight=0)
    with pytest.raises(ValueError, match="p_busy_s"):
        LocalPrefillSpec(p_busy_s=0)
