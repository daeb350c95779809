"""With every P down, D serves what it can prefill itself rather than a 503 (router/local_prefill.py
"p_down"): the picker's choice and the lifecycle's move off a lost P, on hand-placed caches."""

from __future__ import annotations

import pytest
from test_routing import BS, Clock, HeldBlocks, Inst, family

from pdcluster.proto.messages import SamplingSpec
from pdcluster.proto.router_spec import LocalPrefillSpec
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import Lifecycle
from pdcluster.router.lifecycle_commands import Abort, Decode, Failure, Prefill, Routed
from pdcluster.router.local_prefill import LocalView, decide
from pdcluster.router.routing import InstancePicker, NoInstanceUp

PROMPT = family(1, n=24)


def picker(up: set[str], local: bool = True) -> InstancePicker:
    spec = LocalPrefillSpec(policy="short_remainder", max_tokens=8) if local else None
    return InstancePicker("prefix_aware", [Inst("p0")], [Inst("d0"), Inst("d1")], BS, HeldBlocks(),
                          is_up=lambda name: name in up, clock=Clock(), local=spec)


def test_no_p_up_is_a_local_prefill_whatever_the_remainder():
    d = decide(LocalPrefillSpec(policy="short_remainder", max_tokens=8), LocalView(4096, 0, True, 5, 0.0, p_up=False))
    assert (d.local, d.reason, d.remainder_tokens) == (True, "p_down", 4096)
    never = decide(LocalPrefillSpec(policy="never"), LocalView(4096, 0, False, 0, 0.0, p_up=False))
    assert (never.local, never.reason) == (False, "never")


def test_with_p_down_the_picker_sends_d_the_whole_prompt_and_without_local_prefill_it_is_503():
    route = picker({"d0", "d1"}).pick(PROMPT, 4)
    assert route.local_prefill and route.local.reason == "p_down" and route.local.remainder_tokens == len(PROMPT)
    assert route.decode.name in ("d0", "d1") and route.predicted_p_hit_tokens is None
    with pytest.raises(NoInstanceUp, match=r"^no prefill instance is up \(p0 all down\)$"):
        picker({"d0", "d1"}, local=False).pick(PROMPT, 4)


def test_a_request_whose_only_p_is_lost_moves_to_d_alone():
    up = {"p0", "d0", "d1"}
    pk = picker(up)
    disp = Dispatch(pk, request_timeout_s=60)
    lc = Lifecycle(disp, "r0", list(PROMPT), SamplingSpec(max_tokens=4), arrival_ns=100)
    routed, prefill = lc.start(105)
    assert isinstance(prefill, Prefill) and not routed.route.local_prefill  # 20 tokens: over 8, through P
    up.discard("p0")
    abort, moved, decode = lc.prefill_failed(0, Failure("lost", "its connection closed"), 110)
    assert isinstance(abort, Abort) and isinstance(moved, Routed) and isinstance(decode, Decode)
    assert moved.route.local.reason == "p_down" and decode.request.handle is None
    assert [m.lost for m in lc.rec.migrations] == ["p0"]
    lc.cancel(stopping=True)
    lc.close(120)
    assert not any(disp.picker.in_flight().values())
