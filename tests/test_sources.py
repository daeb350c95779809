"""Unit tests of P's transfer sources (transfer/sources.py): readiness per layer, and the lease."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.transfer.sources import SourceError, SourceTable, TransferIdInUse, TransferIds, ready_blocks

LAYERS = {"l0": 0, "l1": 0, "w0": 1}  # two full-attention layers (block 16), one window layer (block 4)
BLOCK_SIZES = (16, 4)
TABLE = ((3, 5, 8), (1, 2, 4, 6, 7, 9, 10, 11, 12, 13))  # a 40-token prompt


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock) -> SourceTable:
    return SourceTable(LAYERS, BLOCK_SIZES, clock=clock)


def finished(table, transfer_id="t1", request_id="r1", lease_s=30.0):
    """A prefill that ran in one step and finished."""
    table.step(transfer_id, request_id, 40, TABLE, 40)
    table.step_done()
    table.finish(transfer_id, lease_s)


# ---------------------------------------------------------------- readiness


def test_layers_become_ready_one_by_one(table):
    table.step("t1", "r1", 40, TABLE, 20)  # this step computes tokens [0, 20)
    src = table.acquire("t1", 0)
    assert src.ready_blocks("l0", 0) == 0
    table.layer_done("l0")
    assert (src.ready_blocks("l0", 0), src.ready_blocks("l1", 0)) == (1, 0)  # 20 // 16
    table.step_done()  # every layer, those without a save hook too
    assert (src.ready_blocks("l1", 0), src.ready_blocks("w0", 1)) == (1, 5)
    table.step("t1", "r1", 40, TABLE, 40)
    table.layer_done("l1")
    assert src.ready_blocks("l1", 0) == 3  # the prompt's last, partial block counts once all tokens are in
    assert src.ready_blocks("l0", 0) == 1
    table.unpin(src)


def test_layer_done_outside_a_step_changes_nothing(table):
    finished(table)
    table.layer_done("l0")  # a decode step of another request
    assert table.acquire("t1", 0).ready_tokens == {"l0": 40, "l1": 40, "w0": 40}


def test_step_tokens_capped_at_the_prompt(table):
    table.step("t1", "r1", 40, TABLE, 41)
    table.step_done()
    assert table.acquire("t1", 0).ready_tokens["l0"] == 40


def test_wait_for_progress_wakes_on_a_layer(table):
    table.step("t1", "r1", 40, TABLE, 40)
    src = table.acquire("t1", 0)
    seen = dict(src.ready_tokens)
    threading.Timer(0.05, table.layer_done, ("l0",)).start()
    t0 = time.monotonic()
    table.wait_for_progress(src, seen, timeout_s=5)
    assert time.monotonic() - t0 < 2 and src.ready_tokens["l0"] == 40


def test_preemption_clears_progress(table):
    table.step("t1", "r1", 40, TABLE, 40)
    table.step_done()
    table.preempted("r1")
    src = table.acquire("t1", 0)
    assert src.ready_blocks("l0", 0) == 0 and src.block_ids == ()


def test_same_transfer_from_two_requests_asserts(table):
    table.step("t1", "r1", 40, TABLE, 16)
    with pytest.raises(AssertionError, match="reused an id"):
        table.step("t1", "r2", 40, TABLE, 16)


# ---------------------------------------------------------------- the lease


def test_running_source_never_finishes(table, clock):
    table.step("t1", "r1", 40, TABLE, 16)
    table.release("t1")  # D got everything it wanted early
    clock.advance(10_000)
    assert table.take_finished() == set()  # vLLM has not handed the blocks over yet
    table.finish("t1", lease_s=30)
    assert table.take_finished() == {"r1"}


def test_live_lease_is_not_finished(table, clock):
    finished(table)
    clock.advance(29.9)
    assert table.take_finished() == set()
    assert len(table) == 1


def test_released_source_reported_once_by_request_id(table):
    finished(table, "t1", "r1")
    finished(table, "t2", "r2")
    assert table.release("t1") is True
    assert table.take_finished() == {"r1"}
    assert table.take_finished() == set()
    assert len(table) == 1


def test_release_twice_or_unknown_is_false(table):
    finished(table)
    assert table.release("t1") is True
    assert table.release("t1") is False
    assert table.release("nobody") is False


def test_a_transfer_released_before_ps_first_step_starts_released_and_ends_with_its_prefill(table):
    """D refused the request before P scheduled it (push): P's blocks go when its prefill ends."""
    assert table.release("t1") is False
    table.step("t1", "r1", 40, TABLE, 40)
    with pytest.raises(SourceError, match="released"):
        table.acquire("t1", 0)
    assert table.take_finished() == set()  # the running request owns its blocks
    table.step_done()
    table.finish("t1", 30.0)
    assert table.take_finished() == {"r1"}  # at once, not after the lease
    finished(table, "t1", "r2")  # remembered once: a source made again is not released
    assert table.take_finished() == set()


def test_early_releases_are_bounded(table, monkeypatch):
    monkeypatch.setattr("pdcluster.transfer.sources.EARLY_RELEASES", 2)
    for name in ("a", "b", "c"):
        table.release(name)
    for name in ("a", "c"):
        table.step(name, f"r-{name}", 40, TABLE, 40)
    assert [table.acquire(n, 0).transfer_id for n in ("a",)] == ["a"]  # forgotten: not released
    with pytest.raises(SourceError):
        table.acquire("c", 0)


def test_expired_source_reported(table, clock):
    finished(table)
    clock.advance(30)
    assert table.take_finished() == {"r1"}


def test_aborted_source_ends_at_once_and_refuses_readers(table):
    table.step("t1", "r1", 40, TABLE, 16)
    table.finish("t1", lease_s=30, aborted=True)
    with pytest.raises(SourceError, match="aborted on P"):
        table.acquire("t1", 0)
    assert table.take_finished() == {"r1"}


def test_pinned_source_not_reported_until_unpinned(table, clock):
    finished(table)
    src = table.acquire("t1", 0)
    table.release("t1")
    clock.advance(100)
    assert table.take_finished() == set()
    table.unpin(src)
    assert table.take_finished() == {"r1"}


def test_two_readers_both_must_unpin(table):
    finished(table)
    a, b = table.acquire("t1", 0), table.acquire("t1", 0)
    assert a is b and a.readers == 2
    table.release("t1")
    table.unpin(a)
    assert table.take_finished() == set()
    table.unpin(b)
    assert table.take_finished() == {"r1"}


@pytest.mark.parametrize("end, why", [("release", "released"), ("expire", "expired")])
def test_acquire_ended_source_raises(table, clock, end, why):
    finished(table)
    table.release("t1") if end == "release" else clock.advance(31)
    with pytest.raises(SourceError, match=f"transfer t1 already {why}"):
        table.acquire("t1", 0)
    assert table.take_finished() == {"r1"}  # the failed acquire did not pin it


def test_acquire_unknown_without_wait_raises(table):
    with pytest.raises(SourceError, match="no transfer ghost on this P"):
        table.acquire("ghost", 0)


def test_unpin_without_acquire_asserts(table):
    finished(table)
    src = table.acquire("t1", 0)
    table.unpin(src)
    with pytest.raises(AssertionError, match="without acquire"):
        table.unpin(src)


def test_finish_of_unknown_transfer_asserts(table):
    with pytest.raises(AssertionError, match="never ran on this worker"):
        table.finish("ghost", 30)


def test_acquire_waits_for_a_source_added_by_another_thread():
    table = SourceTable(LAYERS, BLOCK_SIZES)
    threading.Timer(0.05, lambda: table.step("t1", "r1", 40, TABLE, 16)).start()
    t0 = time.monotonic()
    src = table.acquire("t1", wait_s=5)
    assert src.transfer_id == "t1" and time.monotonic() - t0 < 2


def test_acquire_raises_after_wait_if_never_added():
    table = SourceTable(LAYERS, BLOCK_SIZES)
    t0 = time.monotonic()
    with pytest.raises(SourceError):
        table.acquire("t1", wait_s=0.1)
    assert 0.1 <= time.monotonic() - t0 < 1


def test_a_block_is_readable_once_whole_and_the_last_once_the_prompt_is_done():
    assert [ready_blocks(t, 40, 16) for t in (0, 15, 16, 39, 40)] == [0, 0, 1, 2, 3]


# ---------------------------------------------------------------- P's engine: transfer ids in use


def test_a_transfer_id_is_refused_while_its_source_may_exist(clock):
    ids = TransferIds(lease_s=30, clock=clock)
    ids.take("t1")
    with pytest.raises(TransferIdInUse, match="'t1' is in use"):
        ids.take("t1")  # running
    ids.end("t1")
    clock.advance(29)
    with pytest.raises(TransferIdInUse):
        ids.take("t1")  # within its lease: the worker may still hold its source
    ids.take("t2")
    clock.advance(1)
    ids.take("t3")  # t1's lease is over: forgotten
    assert len(ids) == 2
    ids.take("t1")


def test_an_id_s_lease_counts_from_its_first_end(clock):
    ids = TransferIds(lease_s=30, clock=clock)
    ids.take("t1")
    ids.end("t1")
    clock.advance(10)
    ids.end("t1")  # a second end does not extend it
    clock.advance(20)
    ids.take("t9")
    assert len(ids) == 1
