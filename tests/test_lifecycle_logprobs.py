"""Prompt logprobs through the lifecycle (router/lifecycle.py), driven by hand: whoever prefills
computes them (P, or D alone), D is not asked for them behind a P, and the last chunk carries
the first prefiller's, or the request fails rather than finish without them."""

from __future__ import annotations

import dataclasses

from test_lifecycle import PROMPT, answer, dispatch, kinds, last
from test_routing import BS, Clock, HeldBlocks, Inst

from pdcluster.proto.messages import DecodeDelta, SamplingSpec, TokenLogprobs
from pdcluster.proto.router_spec import LocalPrefillSpec
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import Lifecycle
from pdcluster.router.lifecycle_commands import Failure
from pdcluster.router.routing import InstancePicker

PROMPT_LP = (None,) + tuple(TokenLogprobs((t,), (-0.5 * t,), (3,)) for t in PROMPT[1:])


def lifecycle(disp, prompt_logprobs=0) -> Lifecycle:
    return Lifecycle(disp, "r0", list(PROMPT), SamplingSpec(max_tokens=4, prompt_logprobs=prompt_logprobs), 100)


def test_p_computes_them_d_is_not_asked_and_the_last_chunk_carries_them():
    lc = lifecycle(dispatch("pull"))
    _, prefill = lc.start(0)
    assert prefill.request.sampling.prompt_logprobs == 0
    [decode] = lc.prefill_answered(0, dataclasses.replace(answer(), prompt_logprobs=PROMPT_LP), 1)
    assert decode.request.sampling.prompt_logprobs is None
    [emit] = lc.decode_output(0, DecodeDelta([7]), 2)
    assert emit.chunk.prompt_logprobs == ()
    emit, *_ = lc.decode_output(0, last([8, 9, 10]), 3)
    assert emit.chunk.prompt_logprobs == PROMPT_LP


def test_without_them_asked_none_are_carried():
    lc = lifecycle(dispatch("pull"), prompt_logprobs=None)
    lc.start(0)
    lc.prefill_answered(0, answer(), 1)
    emit, *_ = lc.decode_output(0, last([8]), 3)
    assert emit.chunk.prompt_logprobs == () and lc.close(4).error is None


def test_d_prefilling_alone_computes_them():
    picker = InstancePicker("prefix_aware", [Inst("p0")], [Inst("d0")], BS, HeldBlocks(), is_up=lambda n: n == "d0",
                            clock=Clock(), local=LocalPrefillSpec(policy="short_remainder", max_tokens=8))
    lc = lifecycle(Dispatch(picker))  # P down: D prefills alone
    _, decode = lc.start(0)
    assert decode.request.sampling.prompt_logprobs == 0 and decode.request.handle is None
    lc.decode_output(0, DecodeDelta([7], prompt_logprobs=PROMPT_LP), 1)
    emit, *_ = lc.decode_output(0, last([8]), 2)
    assert emit.chunk.prompt_logprobs == PROMPT_LP


def test_push_p_lost_after_d_had_its_kv_fails_the_request_rather_than_drop_them():
    lc = lifecycle(dispatch("push"))
    lc.start(0)
    lc.decode_output(0, DecodeDelta([7]), 10)
    assert lc.prefill_failed(0, Failure("lost", "ActorDiedError"), 20) == []
    assert kinds(lc.decode_output(0, last([8]), 30))[-1] == "Finished"
    assert "prompt's logprobs were lost" in lc.close(40).error
