"""Unit tests of the pure transfer plan (transfer/plan.py) and the transfer handle (transfer/handle.py)."""

from __future__ import annotations

import pytest

from pdcluster.transfer.handle import HANDLE_KEY, HandleError, TransferHandle
from pdcluster.transfer.plan import GroupPlan, PlanError, TransferPlan, blocks_for, plan_full_attention, plan_transfer

# ---------------------------------------------------------------- factories


def make_handle(**overrides) -> TransferHandle:
    fields = dict(engine_id="p0", address="10.0.0.1:5555", request_id="req-1",
                  block_ids=((7, 3, 9), (4, 1)), num_tokens=40)
    fields.update(overrides)
    return TransferHandle(**fields)


def handle_dict(**overrides) -> dict:
    d = {"engine_id": "p0", "address": "10.0.0.1:5555", "request_id": "req-1",
         "block_ids": [[7, 3, 9]], "num_tokens": 40}
    d.update(overrides)
    return d


# ---------------------------------------------------------------- plan_full_attention


def test_full_attention_no_d_hit_pairs_all_blocks_in_order():
    g = plan_full_attention(0, remote=(10, 11, 12, 13), local_new=(3, 1, 4, 2), num_local_hit_blocks=0)
    assert g == GroupPlan(0, "full_attention", (10, 11, 12, 13), (3, 1, 4, 2))
    assert g.num_blocks == 4


def test_full_attention_d_hit_reads_only_remote_past_the_hit():
    g = plan_full_attention(2, remote=(10, 11, 12, 13, 14), local_new=(7, 8), num_local_hit_blocks=3)
    assert g.group == 2
    assert g.remote_block_ids == (13, 14)
    assert g.local_block_ids == (7, 8)
    assert g.num_blocks == 2


def test_full_attention_d_holds_everything_is_empty():
    g = plan_full_attention(0, remote=(10, 11, 12), local_new=(), num_local_hit_blocks=3)
    assert g.remote_block_ids == () and g.local_block_ids == ()
    assert g.num_blocks == 0


@pytest.mark.parametrize("remote, local_new, hits, expected", [
    ((10, 11, 12), (1, 2), 0, 3),  # D allocated too few
    ((10, 11, 12), (1, 2, 3), 1, 2),  # D allocated too many past its hit
])
def test_full_attention_mismatched_lengths_names_group_and_counts(remote, local_new, hits, expected):
    with pytest.raises(PlanError) as err:
        plan_full_attention(5, remote, local_new, hits)
    msg = str(err.value)
    assert "group 5" in msg
    assert f"P has {len(remote)} blocks" in msg
    assert f"D holds {hits}" in msg
    assert f"allocated {len(local_new)}" in msg
    assert f"expected {expected}" in msg


def test_group_plan_rejects_unpaired_lists():
    with pytest.raises(AssertionError, match="group 1"):
        GroupPlan(1, "full_attention", (1, 2), (3,))


# ---------------------------------------------------------------- plan_transfer


def test_plan_transfer_two_groups_with_different_hits():
    plan = plan_transfer(("full_attention", "full_attention"),
                         remote=((10, 11, 12, 13), (20, 21, 22, 23)),
                         local_new=((5, 6), (1, 2, 3, 4)),
                         num_local_hit_blocks=(2, 0), d_cached_tokens=32, num_tokens=60)
    assert plan.groups == (
        GroupPlan(0, "full_attention", (12, 13), (5, 6)),
        GroupPlan(1, "full_attention", (20, 21, 22, 23), (1, 2, 3, 4)),
    )
    assert plan.num_blocks == 6
    assert plan.d_cached_tokens == 32
    assert plan.transferred_tokens == 28


def test_plan_transfer_d_holds_everything_moves_nothing():
    plan = plan_transfer(("full_attention",), remote=((10, 11),), local_new=((),),
                         num_local_hit_blocks=(2,), d_cached_tokens=32, num_tokens=32)
    assert plan.num_blocks == 0
    assert plan.transferred_tokens == 0
    assert plan.groups[0].remote_block_ids == ()


def test_plan_transfer_mismatch_in_a_later_group_names_it():
    with pytest.raises(PlanError, match=r"^group 1: P has 2 blocks, D holds 0 and allocated 1"):
        plan_transfer(("full_attention", "full_attention"), remote=((1, 2), (3, 4)), local_new=((5, 6), (7,)),
                      num_local_hit_blocks=(0, 0), d_cached_tokens=0, num_tokens=32)


@pytest.mark.parametrize("kinds, remote, local_new, hits", [
    (("full_attention",), ((1,), (2,)), ((3,),), (0,)),  # P has more groups
    (("full_attention", "full_attention"), ((1,), (2,)), ((3,),), (0, 0)),  # D has fewer groups
    (("full_attention", "full_attention"), ((1,), (2,)), ((3,), (4,)), (0,)),  # hits per group missing
])
def test_plan_transfer_group_count_mismatch(kinds, remote, local_new, hits):
    with pytest.raises(PlanError, match="group counts differ"):
        plan_transfer(kinds, remote, local_new, hits, d_cached_tokens=0, num_tokens=16)


def test_plan_transfer_unknown_kind():
    with pytest.raises(PlanError, match=r"group 1: no transfer rule for 'mamba'"):
        plan_transfer(("full_attention", "mamba"), ((1,), (2,)), ((3,), (4,)), (0, 0),
                      d_cached_tokens=0, num_tokens=16)


def test_sliding_window_pairs_d_window_blocks_with_p_tail():
    # P holds its window's last 3 blocks; D allocated 2 (its own hit covers the first).
    plan = plan_transfer(("full_attention", "sliding_window"), ((10, 11, 12, 13, 14), (22, 23, 24)),
                         ((31, 32, 33, 34, 35), (41, 42)), (0, 0), d_cached_tokens=0, num_tokens=600)
    assert plan.groups[1] == GroupPlan(1, "sliding_window", (23, 24), (41, 42))
    assert plan.groups[0].remote_block_ids == (10, 11, 12, 13, 14)
    # Bytes for the window group are bounded by the window, whatever the prompt length.
    assert plan.groups[1].num_blocks == 2


def test_sliding_window_more_d_blocks_than_p_holds_is_an_error():
    with pytest.raises(PlanError, match="group 0: D wants 3 window blocks, P holds only 2"):
        plan_transfer(("sliding_window",), ((1, 2),), ((5, 6, 7),), (0,), d_cached_tokens=0, num_tokens=300)


def test_transfer_plan_num_blocks_sums_groups():
    plan = TransferPlan((GroupPlan(0, "full_attention", (1, 2, 3), (4, 5, 6)),
                         GroupPlan(1, "full_attention", (), ()),
                         GroupPlan(2, "full_attention", (7,), (8,))), d_cached_tokens=0, transferred_tokens=48)
    assert plan.num_blocks == 4
    assert TransferPlan((), 16, 0).num_blocks == 0


@pytest.mark.parametrize("tokens, block_size, blocks", [
    (0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5),
])
def test_blocks_for_rounds_up(tokens, block_size, blocks):
    assert blocks_for(tokens, block_size) == blocks


# ---------------------------------------------------------------- TransferHandle


def test_handle_round_trip_through_params():
    h = make_handle()
    params = h.to_params()
    assert set(params) == {HANDLE_KEY}
    # kv_transfer_params is a plain (JSON-able) dict: lists, not tuples.
    assert params[HANDLE_KEY]["block_ids"] == [[7, 3, 9], [4, 1]]
    back = TransferHandle.from_params(params)
    assert back == h
    assert isinstance(back.block_ids, tuple) and all(isinstance(g, tuple) for g in back.block_ids)


def test_handle_round_trip_keeps_other_params_out():
    params = {"pdc_produce": True, **make_handle(block_ids=((1,),), num_tokens=0).to_params()}
    assert TransferHandle.from_params(params) == make_handle(block_ids=((1,),), num_tokens=0)


@pytest.mark.parametrize("params", [None, {}, {"pdc_produce": True}])
def test_handle_absent_is_none(params):
    assert TransferHandle.from_params(params) is None


@pytest.mark.parametrize("d", [
    {k: v for k, v in handle_dict().items() if k != "request_id"},  # missing key
    handle_dict(num_tokens="many"),  # not an int
    handle_dict(block_ids=5),  # not a list of groups
    handle_dict(block_ids=[[1, "x"]]),  # not a block id
    handle_dict(num_tokens=-1),  # negative count
    "not a dict",
    None,
])
def test_handle_malformed_raises(d):
    with pytest.raises(HandleError, match="malformed transfer handle"):
        TransferHandle.from_params({HANDLE_KEY: d})


def test_handle_bad_address_in_params_raises():
    with pytest.raises(HandleError, match="not host:port"):
        TransferHandle.from_params({HANDLE_KEY: handle_dict(address="localhost")})


def test_handle_bad_address_raises():
    with pytest.raises(HandleError, match=r"'localhost' is not host:port"):
        make_handle(address="localhost")


def test_handle_negative_tokens_raises():
    with pytest.raises(HandleError, match="num_tokens=-3"):
        make_handle(num_tokens=-3)
