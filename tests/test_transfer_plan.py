"""Unit tests of the pure transfer plan (transfer/plan.py) and the transfer handle (proto/handle.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdcluster.proto.handle import HANDLE_KEY, PRODUCE_KEY, HandleError, TransferHandle, transfer_id_of
from pdcluster.transfer.plan import (
    GroupPlan,
    PlanError,
    TransferPlan,
    blocks_for,
    plan_full_attention,
    plan_transfer,
    plan_window_tail,
)

# ---------------------------------------------------------------- factories


@dataclass(frozen=True)
class Shape:  # a GroupShape
    kind: str = "full_attention"
    block_size: int = 16
    window_blocks: int = 0


FULL = Shape()


def window(window_blocks: int, block_size: int = 16) -> Shape:
    return Shape("sliding_window", block_size, window_blocks)


def make_handle(**overrides) -> TransferHandle:
    fields = dict(engine_id="p0", address="10.0.0.1:5555", transfer_id="req-1", num_tokens=40)
    fields.update(overrides)
    return TransferHandle(**fields)


def handle_dict(**overrides) -> dict:
    d = {"engine_id": "p0", "address": "10.0.0.1:5555", "transfer_id": "req-1", "num_tokens": 40,
         "transport": "grpc"}
    d.update(overrides)
    return d


# ---------------------------------------------------------------- plan_full_attention


def test_full_attention_no_d_hit_pairs_all_blocks_in_order():
    g = plan_full_attention(0, num_remote=4, local_new=(3, 1, 4, 2), num_local_hit_blocks=0)
    assert g == GroupPlan(0, "full_attention", (0, 1, 2, 3), (3, 1, 4, 2))
    assert g.num_blocks == 4


def test_full_attention_d_hit_reads_only_remote_past_the_hit():
    g = plan_full_attention(2, num_remote=5, local_new=(7, 8), num_local_hit_blocks=3)
    assert g.group == 2
    assert g.remote_indices == (3, 4)
    assert g.local_block_ids == (7, 8)
    assert g.num_blocks == 2


def test_full_attention_d_holds_everything_is_empty():
    g = plan_full_attention(0, num_remote=3, local_new=(), num_local_hit_blocks=3)
    assert g.remote_indices == () and g.local_block_ids == ()
    assert g.num_blocks == 0


@pytest.mark.parametrize("num_remote, local_new, hits, expected", [
    (3, (1, 2), 0, 3),  # D allocated too few
    (3, (1, 2, 3), 1, 2),  # D allocated too many past its hit
])
def test_full_attention_mismatched_lengths_names_group_and_counts(num_remote, local_new, hits, expected):
    with pytest.raises(PlanError) as err:
        plan_full_attention(5, num_remote, local_new, hits)
    msg = str(err.value)
    assert "group 5" in msg
    assert f"P has {num_remote} blocks" in msg
    assert f"D holds {hits}" in msg
    assert f"allocated {len(local_new)}" in msg
    assert f"expected {expected}" in msg


def test_group_plan_rejects_unpaired_lists():
    with pytest.raises(AssertionError, match="group 1"):
        GroupPlan(1, "full_attention", (1, 2), (3,))


def test_group_plan_rejects_unordered_indices():
    with pytest.raises(AssertionError, match="not ascending"):
        GroupPlan(0, "full_attention", (2, 1), (3, 4))


# ---------------------------------------------------------------- plan_window_tail


def test_window_tail_is_the_last_blocks_of_the_prompt():
    assert plan_window_tail(1, num_remote=38, local_new=(41, 42, 43), window_blocks=3) == \
        GroupPlan(1, "sliding_window", (35, 36, 37), (41, 42, 43))


def test_window_tail_short_prompt_has_fewer_blocks_than_the_window():
    assert plan_window_tail(0, num_remote=2, local_new=(5, 6), window_blocks=3).remote_indices == (0, 1)


@pytest.mark.parametrize("num_remote, local_new, holds", [(38, (1, 2, 3, 4), 3), (2, (1, 2, 3), 2)])
def test_window_tail_more_d_blocks_than_p_holds_is_an_error(num_remote, local_new, holds):
    with pytest.raises(PlanError, match=f"group 0: D wants {len(local_new)} window blocks, P holds only {holds}"):
        plan_window_tail(0, num_remote, local_new, window_blocks=3)


# ---------------------------------------------------------------- plan_transfer


def test_plan_transfer_two_groups_with_different_hits():
    plan = plan_transfer((FULL, FULL), local_new=((5, 6), (1, 2, 3, 4)), num_local_hit_blocks=(2, 0),
                         d_cached_tokens=32, num_tokens=60)
    assert plan.groups == (
        GroupPlan(0, "full_attention", (2, 3), (5, 6)),
        GroupPlan(1, "full_attention", (0, 1, 2, 3), (1, 2, 3, 4)),
    )
    assert plan.num_blocks == 6
    assert plan.d_cached_tokens == 32
    assert plan.transferred_tokens == 28


def test_plan_transfer_counts_blocks_per_group_block_size():
    # 600 tokens: 5 blocks of 128, 10 of 64, 150 of 4 (DeepSeek-V4 mixes sizes like this).
    plan = plan_transfer((Shape(block_size=128), window(3, 64), window(3, 4)), ((1, 2, 3, 4, 5), (7, 8), (9, 10, 11)),
                         (0, 0, 0), d_cached_tokens=0, num_tokens=600)
    assert [g.remote_indices for g in plan.groups] == [(0, 1, 2, 3, 4), (8, 9), (147, 148, 149)]


def test_plan_transfer_d_holds_everything_moves_nothing():
    plan = plan_transfer((FULL,), local_new=((),), num_local_hit_blocks=(2,), d_cached_tokens=32, num_tokens=32)
    assert plan.num_blocks == 0
    assert plan.transferred_tokens == 0
    assert plan.groups[0].remote_indices == ()


def test_plan_transfer_mismatch_in_a_later_group_names_it():
    with pytest.raises(PlanError, match=r"^group 1: P has 2 blocks, D holds 0 and allocated 1"):
        plan_transfer((FULL, FULL), local_new=((5, 6), (7,)), num_local_hit_blocks=(0, 0), d_cached_tokens=0,
                      num_tokens=32)


@pytest.mark.parametrize("shapes, local_new, hits", [
    ((FULL,), ((3,), (4,)), (0,)),  # D has more groups
    ((FULL, FULL), ((3,),), (0, 0)),  # D has fewer groups
    ((FULL, FULL), ((3,), (4,)), (0,)),  # hits per group missing
])
def test_plan_transfer_group_count_mismatch(shapes, local_new, hits):
    with pytest.raises(PlanError, match="group counts differ"):
        plan_transfer(shapes, local_new, hits, d_cached_tokens=0, num_tokens=16)


def test_plan_transfer_unknown_kind():
    with pytest.raises(PlanError, match=r"group 1: no transfer rule for 'mamba'"):
        plan_transfer((FULL, Shape("mamba")), ((3,), (4,)), (0, 0), d_cached_tokens=0, num_tokens=16)


def test_sliding_window_bytes_bounded_by_the_window_not_the_prompt():
    for num_tokens in (600, 6_000, 60_000):
        n = blocks_for(num_tokens, 16)
        plan = plan_transfer((FULL, window(3)), (tuple(range(n)), (41, 42, 43)), (0, 0), d_cached_tokens=0,
                             num_tokens=num_tokens)
        assert plan.groups[0].num_blocks == n
        assert plan.groups[1] == GroupPlan(1, "sliding_window", (n - 3, n - 2, n - 1), (41, 42, 43))


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
    assert params[HANDLE_KEY] == handle_dict()  # a plain (JSON-able) dict
    assert TransferHandle.from_params(params) == h


def test_handle_round_trip_keeps_other_params_out():
    params = {PRODUCE_KEY: "t1", **make_handle(num_tokens=0).to_params()}
    assert TransferHandle.from_params(params) == make_handle(num_tokens=0)


@pytest.mark.parametrize("params", [None, {}, {PRODUCE_KEY: "t1"}])
def test_handle_absent_is_none(params):
    assert TransferHandle.from_params(params) is None


@pytest.mark.parametrize("d", [
    {k: v for k, v in handle_dict().items() if k != "transfer_id"},  # missing key
    handle_dict(num_tokens="many"),  # not an int
    handle_dict(num_tokens=-1),  # negative count
    handle_dict(transfer_id=""),  # no name
    handle_dict(transport="pigeon"),  # no such transport
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


@pytest.mark.parametrize("params, expected", [
    ({PRODUCE_KEY: "t-7"}, "t-7"), ({PRODUCE_KEY: True}, None), ({PRODUCE_KEY: ""}, None), ({}, None), (None, None),
])
def test_transfer_id_of_p_params(params, expected):
    assert transfer_id_of(params) == expected
