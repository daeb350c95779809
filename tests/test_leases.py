"""Unit tests of P's lease table (transfer/leases.py)."""

from __future__ import annotations

import threading
import time

import pytest

from pdcluster.transfer.leases import LeaseError, LeaseTable

BLOCKS = ((3, 5, 8),)


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
def table(clock) -> LeaseTable:
    return LeaseTable(clock=clock)


def test_add_then_acquire_returns_the_lease(table, clock):
    table.add("r1", ((1, 2), (7,)), lease_s=30)
    assert len(table) == 1
    lease = table.acquire("r1", wait_s=0)
    assert lease.request_id == "r1"
    assert lease.block_ids == ((1, 2), (7,))
    assert lease.blocks_set == (frozenset({1, 2}), frozenset({7}))
    assert lease.expires_at == clock.now + 30
    assert lease.readers == 1
    table.unpin(lease)
    assert lease.readers == 0


def test_live_lease_is_not_finished(table, clock):
    table.add("r1", BLOCKS, lease_s=30)
    clock.advance(29.9)
    assert table.take_finished() == set()
    assert len(table) == 1


def test_released_lease_reported_once(table):
    table.add("r1", BLOCKS, lease_s=30)
    table.add("r2", BLOCKS, lease_s=30)
    assert table.release("r1") is True
    assert table.take_finished() == {"r1"}
    assert table.take_finished() == set()
    assert len(table) == 1  # r2 still held


def test_release_twice_or_unknown_is_false(table):
    table.add("r1", BLOCKS, lease_s=30)
    assert table.release("r1") is True
    assert table.release("r1") is False
    assert table.release("nobody") is False
    assert table.take_finished() == {"r1"}
    assert table.release("r1") is False  # gone


def test_expired_lease_reported(table, clock):
    table.add("r1", BLOCKS, lease_s=10)
    table.add("r2", BLOCKS, lease_s=20)
    clock.advance(10)  # exactly at expiry: ended
    assert table.take_finished() == {"r1"}
    clock.advance(100)
    assert table.take_finished() == {"r2"}
    assert table.take_finished() == set()
    assert len(table) == 0


def test_pinned_released_lease_not_reported_until_unpinned(table):
    table.add("r1", BLOCKS, lease_s=30)
    lease = table.acquire("r1", wait_s=0)
    assert table.release("r1") is True
    assert table.take_finished() == set()
    table.unpin(lease)
    assert table.take_finished() == {"r1"}


def test_pinned_expired_lease_not_reported_until_unpinned(table, clock):
    table.add("r1", BLOCKS, lease_s=10)
    lease = table.acquire("r1", wait_s=0)
    clock.advance(60)
    assert table.take_finished() == set()
    table.unpin(lease)
    assert table.take_finished() == {"r1"}


def test_two_readers_both_must_unpin(table):
    table.add("r1", BLOCKS, lease_s=30)
    a = table.acquire("r1", wait_s=0)
    b = table.acquire("r1", wait_s=0)
    assert a is b and a.readers == 2
    table.release("r1")
    table.unpin(a)
    assert table.take_finished() == set()
    table.unpin(b)
    assert table.take_finished() == {"r1"}


def test_acquire_released_lease_raises(table):
    table.add("r1", BLOCKS, lease_s=30)
    table.release("r1")
    with pytest.raises(LeaseError, match="r1 already released"):
        table.acquire("r1", wait_s=0)


def test_acquire_expired_lease_raises(table, clock):
    table.add("r1", BLOCKS, lease_s=30)
    clock.advance(30)
    with pytest.raises(LeaseError, match="r1 already expired"):
        table.acquire("r1", wait_s=0)


def test_acquire_ended_lease_does_not_pin_it(table):
    table.add("r1", BLOCKS, lease_s=30)
    table.release("r1")
    with pytest.raises(LeaseError):
        table.acquire("r1", wait_s=0)
    assert table.take_finished() == {"r1"}


def test_acquire_unknown_without_wait_raises(table):
    with pytest.raises(LeaseError, match="no lease for r9"):
        table.acquire("r9", wait_s=0)


def test_lease_error_is_a_key_error():
    assert issubclass(LeaseError, KeyError)


def test_unpin_without_acquire_asserts(table):
    table.add("r1", BLOCKS, lease_s=30)
    lease = table.acquire("r1", wait_s=0)
    table.unpin(lease)
    with pytest.raises(AssertionError, match="without acquire"):
        table.unpin(lease)


def test_double_add_asserts(table):
    table.add("r1", BLOCKS, lease_s=30)
    with pytest.raises(AssertionError, match="r1 added twice"):
        table.add("r1", BLOCKS, lease_s=30)


# ---------------------------------------------------------------- waiting (real clock and thread)


def test_acquire_waits_for_a_lease_added_by_another_thread():
    table = LeaseTable()  # real monotonic clock: acquire really waits
    adder = threading.Timer(0.1, table.add, args=("r1", BLOCKS, 30.0))
    adder.start()
    try:
        t0 = time.monotonic()
        lease = table.acquire("r1", wait_s=2.0)
        waited = time.monotonic() - t0
    finally:
        adder.cancel()
        adder.join()
    assert lease.request_id == "r1" and lease.readers == 1
    assert 0.05 <= waited < 1.5  # woke on add, not at the deadline


def test_acquire_raises_after_wait_if_never_added():
    table = LeaseTable()
    t0 = time.monotonic()
    with pytest.raises(LeaseError, match="no lease for r1"):
        table.acquire("r1", wait_s=0.2)
    waited = time.monotonic() - t0
    assert 0.18 <= waited < 1.0
