"""router/lifecycle.py driven by hand, transition by transition: no sockets, no tasks, no sleeps.
Each step names the input and the commands it must answer, and the record and the picker's
counts where they change."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeDelta, EngineTimes, PrefillResult, SamplingSpec, TransferStats
from pdcluster.router.admission import AdmissionLimits
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import Lifecycle
from pdcluster.router.lifecycle_commands import Abort, CheckLost, Decode, Failure, Finished, Prefill, Routed
from pdcluster.router.routing import InstancePicker

PROMPT = [1, 2, 3, 4, 5]


@dataclass(frozen=True)
class Inst:
    name: str
    engine_id: str = ""
    kv_address: str | None = None


def dispatch(mode: str = "pull", n_p: int = 2, n_d: int = 2, **kw) -> Dispatch:
    ps = [Inst(f"prefill-{i}", f"engine-p{i}", f"10.0.0.{i}:1860{i}") for i in range(n_p)]
    ds = [Inst(f"decode-{i}") for i in range(n_d)]
    return Dispatch(InstancePicker("round_robin", ps, ds, block_size=4), transfer_mode=mode, request_timeout_s=60, **kw)


def lifecycle(disp: Dispatch, max_tokens: int = 4, rid: str = "r0") -> Lifecycle:
    return Lifecycle(disp, rid, list(PROMPT), SamplingSpec(max_tokens=max_tokens), arrival_ns=100)


def answer(cached: int = 0, connector_params: dict | None = None) -> PrefillResult:
    return PrefillResult("r0", connector_params, len(PROMPT), cached, EngineTimes(110, 120, 150))


def last(tokens: list[int], reason: str = "length") -> DecodeDelta:
    return DecodeDelta(tokens, reason, TransferStats(d_cached_tokens=0, transferred_tokens=len(PROMPT)), len(PROMPT),
                       EngineTimes(160, 170, 180))


def kinds(commands: list) -> list[str]:
    return [type(c).__name__ for c in commands]


def idle(disp: Dispatch) -> bool:
    return not any(disp.picker.in_flight().values()) and disp.in_flight == 0


def test_pull_prefill_then_decode_with_the_router_s_handle_then_tokens_then_the_record():
    disp = dispatch("pull")
    lc = lifecycle(disp)
    routed, prefill = lc.start(now_ns=105)
    assert isinstance(routed, Routed) and isinstance(prefill, Prefill) and prefill.instance.name == "prefill-0"
    assert prefill.request.transfer_id == prefill.request.request_id == f"pdc-{disp.id_prefix}-0"
    assert lc.waiting_for_prefill and not lc.waiting_for_decode
    assert disp.picker.in_flight() == {"prefill-0": 1, "prefill-1": 0, "decode-0": 0, "decode-1": 0}
    [decode] = lc.prefill_answered(0, answer(cached=4), now_ns=200)
    assert isinstance(decode, Decode) and decode.instance.name == "decode-0"
    assert decode.request.handle == TransferHandle("engine-p0", "10.0.0.0:18600", prefill.request.transfer_id, 5, "grpc")
    assert decode.request.connector_params is None
    assert disp.picker.in_flight() == {"prefill-0": 0, "prefill-1": 0, "decode-0": 1, "decode-1": 0}
    [emit] = lc.decode_output(0, DecodeDelta([7]), now_ns=210)
    assert emit.chunk.new_token_ids == [7] and emit.chunk.pd.p_cached_tokens == 4 and emit.chunk.finish_reason is None
    emit, abort, finished = lc.decode_output(0, last([8, 9, 10]), now_ns=220)
    assert emit.chunk.finish_reason == "length" and emit.chunk.pd.transferred_tokens == 5
    assert isinstance(abort, Abort) and finished == Finished(None)
    rec = lc.close(now_ns=230)
    assert list(rec.events) == ["arrival", "dispatch", "p_queued", "p_scheduled", "p_done", "first_token",
                                "last_token", "d_queued", "d_scheduled", "d_first_token", "finish"]
    assert (rec.output_tokens, rec.p_cached_tokens, rec.transferred_tokens, rec.error) == (4, 4, 5, None)
    assert idle(disp)


def test_the_handle_names_the_dispatch_s_transport_and_another_connector_s_params_pass_on():
    disp = dispatch("pull")
    disp.transport = "torch_dist"
    lc = lifecycle(disp)
    lc.start(0)
    [decode] = lc.prefill_answered(0, answer(), 1)
    assert decode.request.handle.transport == "torch_dist"
    # A P without a KV server (vLLM's NIXL connector): no handle; what P's connector said goes to D.
    disp = Dispatch(InstancePicker("round_robin", [Inst("prefill-0")], [Inst("decode-0")], block_size=4))
    lc = lifecycle(disp)
    lc.start(0)
    [decode] = lc.prefill_answered(0, answer(connector_params={"remote_engine_id": "p"}), 1)
    assert decode.request.handle is None and decode.request.connector_params == {"remote_engine_id": "p"}


def test_push_sends_d_the_router_s_handle_first_and_the_last_chunk_waits_for_p():
    disp = dispatch("push")
    lc = lifecycle(disp)
    routed, decode, prefill = lc.start(0)
    assert kinds([routed, decode, prefill]) == ["Routed", "Decode", "Prefill"]
    assert decode.request.handle == TransferHandle("engine-p0", "10.0.0.0:18600", prefill.request.transfer_id, 5, "grpc")
    assert lc.waiting_for_prefill and lc.waiting_for_decode
    assert kinds(lc.decode_output(0, DecodeDelta([7]), 10)) == ["Emit"]  # D's tokens do not wait for P
    assert lc.decode_output(0, last([8]), 20) == []  # the last one does: P's hit goes in it
    assert not lc.waiting_for_decode and lc.waiting_for_prefill
    emit, _, finished = lc.prefill_answered(0, answer(cached=3), 30)
    assert emit.chunk.pd.p_cached_tokens == 3 and emit.chunk.finish_reason == "length" and finished == Finished(None)
    assert lc.close(40).events["p_done"] == 150 and idle(disp)


def test_push_a_p_failing_after_d_s_first_token_does_not_end_the_request():
    disp = dispatch("push")
    lc = lifecycle(disp)
    lc.start(0)
    lc.decode_output(0, DecodeDelta([7]), 10)
    assert lc.prefill_failed(0, Failure("lost", "ActorDiedError"), 20) == []
    assert kinds(lc.decode_output(0, last([8]), 30)) == ["Emit", "Abort", "Finished"]
    assert lc.close(40).error is None and idle(disp)


def test_engine_ids_are_the_router_s_own_and_unique_across_router_processes():
    """Two router processes (two Dispatches) given one client id name different engine requests
    and transfers, and no id carries the client's (issue 26: two routers gave P one transfer id)."""
    a, b = dispatch(), dispatch()
    ids = [lc.start(0)[1].request for lc in (lifecycle(a, rid="cmpl-x"), lifecycle(b, rid="cmpl-x"),
                                             lifecycle(a, rid="cmpl-x"))]
    assert len({r.transfer_id for r in ids}) == len({r.request_id for r in ids}) == 3
    assert not any("cmpl-x" in r.transfer_id for r in ids)


def test_a_fault_injected_request_s_transfer_keeps_the_fault_prefix():
    disp = dispatch(fault_prefix="cmpl-fault-")
    broken = lifecycle(disp, rid="cmpl-fault-1").start(0)[1].request
    plain = lifecycle(disp, rid="cmpl-1").start(0)[1].request
    assert broken.transfer_id.startswith("cmpl-fault-pdc-") and plain.transfer_id.startswith("pdc-")


def test_push_a_p_lost_before_the_first_token_moves_the_request_to_another_p():
    disp = dispatch("push")
    lc = lifecycle(disp)
    lc.start(0)
    abort, routed, decode, prefill = lc.prefill_failed(0, Failure("lost", "ActorDiedError"), 50)
    assert abort == Abort(0) and routed.attempt == 1 and prefill.instance.name == "prefill-1"
    assert prefill.request.request_id == prefill.request.transfer_id == f"pdc-{disp.id_prefix}-1"
    [move] = lc.rec.migrations
    assert (move.role, move.lost, move.tokens_sent, move.at_ns, move.to) == ("prefill", "prefill-0", 0, 50, "prefill-1")
    assert disp.picker.in_flight()["prefill-0"] == 0 and disp.picker.in_flight()["prefill-1"] == 1
    with pytest.raises(AssertionError, match="attempt 0, which is not running"):
        lc.decode_output(0, DecodeDelta([7]), 60)  # the old attempt's D: the driver dropped it


def test_a_decode_lost_mid_stream_goes_on_with_the_tokens_sent_and_the_rest_of_the_budget():
    disp = dispatch("pull")
    lc = lifecycle(disp, max_tokens=4)
    lc.start(0)
    lc.prefill_answered(0, answer(), 10)
    lc.decode_output(0, DecodeDelta([7, 8]), 20)
    abort, routed, prefill = lc.decode_failed(0, Failure("lost", "connection closed"), 30)
    assert prefill.request.prompt_token_ids == PROMPT + [7, 8] and prefill.request.sampling.max_tokens == 2
    [decode] = lc.prefill_answered(1, answer(), 40)
    assert decode.instance.name == "decode-1"  # decode-0 is avoided
    emit, _, _ = lc.decode_output(1, last([9, 10]), 50)
    assert emit.chunk.pd.migrations == 1
    rec = lc.close(60)
    assert rec.token_ns == [20, 20, 50, 50] and rec.migrations[0].tokens_sent == 2 and idle(disp)


def test_a_request_of_n_choices_lost_after_its_first_tokens_fails_rather_than_move():
    disp = dispatch("pull")
    lc = Lifecycle(disp, "r0", list(PROMPT), SamplingSpec(max_tokens=4, n=2), arrival_ns=100)
    lc.start(0)
    lc.prefill_answered(0, answer(), 10)
    lc.decode_output(0, DecodeDelta([7], index=1), 20)
    *_, finished = lc.decode_failed(0, Failure("lost", "connection closed"), 30)
    assert finished.error.status == 502 and "n=2" in str(finished.error)
    assert "not moved" in lc.close(40).error and idle(disp)


def test_lost_after_its_last_token_it_just_finishes():
    disp = dispatch("pull")
    lc = lifecycle(disp, max_tokens=2)
    lc.start(0)
    lc.prefill_answered(0, answer(), 10)
    lc.decode_output(0, DecodeDelta([7, 8]), 20)
    abort, emit, finished = lc.decode_failed(0, Failure("lost", "gone"), 30)
    assert emit.chunk.new_token_ids == [] and emit.chunk.finish_reason == "length" and finished == Finished(None)


def test_a_failed_kv_load_asks_whether_p_was_lost():
    for p_lost, want in ((True, ["Abort", "Routed", "Prefill"]), (False, ["Abort", "Finished"])):
        disp = dispatch("pull")
        lc = lifecycle(disp)
        lc.start(0)
        lc.prefill_answered(0, answer(), 10)
        [check] = lc.decode_output(0, DecodeDelta([], "error"), 20)
        assert check == CheckLost(0, disp.picker.prefill[0]) and not lc.waiting_for_decode
        out = lc.p_lost(0, p_lost, 30)
        assert kinds(out) == want
        if not p_lost:
            assert out[-1].error.status == 502 and out[-1].error.kind == "kv_transfer_error"
            assert "from prefill-0 failed" in lc.close(40).error and idle(disp)


def test_the_migration_limit_and_no_instance_left_end_it_naming_the_lost_ones():
    disp = dispatch("pull", migration_limit=1)
    lc = lifecycle(disp)
    lc.start(0)
    lc.prefill_failed(0, Failure("lost", "died"), 10)
    *_, finished = lc.prefill_failed(1, Failure("lost", "died"), 20)
    assert finished.error.status == 503 and "already moved 1 times (off prefill-0)" in str(finished.error)
    disp = dispatch("pull", n_p=1)
    lc = lifecycle(disp)
    lc.start(0)
    *_, finished = lc.prefill_failed(0, Failure("lost", "died"), 10)
    assert "no other prefill instance is up" in str(finished.error)
    lc.close(20)
    assert idle(disp)


def test_timeouts_name_the_part_that_was_waited_for():
    disp = dispatch("pull")
    lc = lifecycle(disp)
    lc.start(0)
    *_, finished = lc.timed_out(10)
    assert finished.error.status == 504 and str(finished.error) == "prefill of r0 on prefill-0 timed out after 60 s"
    lc = lifecycle(disp, rid="r1")
    lc.start(0)
    lc.prefill_answered(0, answer(), 10)
    *_, finished = lc.timed_out(20)
    assert str(finished.error) == "decode on decode-1 timed out after 60 s"


def test_an_engine_error_is_500_and_a_dead_engine_core_is_a_lost_instance():
    disp = dispatch("pull")
    lc = lifecycle(disp)
    lc.start(0)
    *_, finished = lc.prefill_failed(0, Failure("error", "ValueError: bad"), 10)
    assert finished.error.status == 500 and str(finished.error) == "prefill on prefill-0 failed: ValueError: bad"
    lc = lifecycle(disp, rid="r1")
    lc.start(0)
    lc.prefill_answered(0, answer(), 10)
    assert kinds(lc.decode_failed(0, Failure("error", "EngineDeadError: core died"), 20))[:2] == ["Abort", "Routed"]


def test_a_client_that_leaves_aborts_the_attempt_and_the_record_says_so():
    disp = dispatch("push")
    lc = lifecycle(disp)
    lc.start(0)
    assert lc.cancel(stopping=False) == [Abort(0)]
    rec = lc.close(10)
    assert rec.error == "cancelled: the client went away or stopped reading" and idle(disp)
    assert lc.close(20) is rec and disp.in_flight == 0  # closing twice changes nothing


def test_a_stream_that_ends_without_a_finish_is_502():
    disp = dispatch("pull")
    lc = lifecycle(disp)
    lc.start(0)
    lc.prefill_answered(0, answer(), 10)
    *_, finished = lc.decode_output(0, None, 20)
    assert finished.error.status == 502 and "ended r0 without a finish" in str(finished.error)


def test_admission_counts_requests_until_they_close():
    disp = dispatch("pull", admission=AdmissionLimits(max_in_flight=1, max_queue_s=60))
    assert disp.admit() is None
    lc = lifecycle(disp)
    assert disp.admit() is not None and disp.admit().reason
    lc.close(0)
    assert disp.admit() is None
