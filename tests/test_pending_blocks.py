"""router/pending_blocks.py: blocks routed but not yet confirmed by KV events."""

from __future__ import annotations

import pytest

from pdcluster.router.pending_blocks import PendingBlocks, PendingCounts
from pdcluster.router.prefix_index import hittable_hashes

BS = 4


def family(n: int, blocks: int = 4, tail: int = 2) -> list[int]:
    """A prompt of `blocks` full blocks of family n, then `tail` tokens of its own."""
    return [1000 * n + i for i in range(blocks * BS)] + [7] * tail


def hashes(prompt: list[int]):
    return hittable_hashes(prompt, BS)


def test_a_routed_requests_blocks_are_pending_at_once_and_only_there():
    pending = PendingBlocks()
    h = hashes(family(1))
    pending.add("prefill-0", "r1", h)
    assert pending.pending_blocks("prefill-0", h) == len(h) == 4
    assert pending.pending_blocks("prefill-1", h) == 0
    assert pending.pending_blocks("prefill-0", hashes(family(2))) == 0
    assert pending.pending_blocks("prefill-0", h, start=3) == 1  # from a confirmed prefix on
    pending.check_integrity()


def test_a_longer_prompt_of_the_family_matches_the_pending_prefix_only():
    pending = PendingBlocks()
    pending.add("p", "r1", hashes(family(1, blocks=2)))
    assert pending.pending_blocks("p", hashes(family(1, blocks=5))) == 2


def test_withdraw_drops_a_failed_requests_blocks_but_not_another_ones():
    pending = PendingBlocks()
    short, long = hashes(family(1, blocks=2)), hashes(family(1, blocks=4))
    pending.add("p", "r1", long)
    pending.add("p", "r2", short)
    pending.withdraw("p", "r1")
    assert pending.pending_blocks("p", long) == 2  # r2 still promises the first two
    pending.withdraw("p", "r2")
    pending.withdraw("p", "r2")  # twice: no effect
    assert pending.pending_blocks("p", long) == 0
    assert pending.counts("p") == PendingCounts(requests=0, blocks=0, withdrawn=2, expired=0)
    pending.check_integrity()


def test_a_finished_request_keeps_its_promise_for_the_grace_then_only_events_count():
    pending = PendingBlocks(grace_s=2.0)
    h = hashes(family(1))
    pending.add("p", "r1", h)
    pending.finished("p", "r1", now=10.0)
    pending.settle("p", now=11.9)
    assert pending.pending_blocks("p", h) == 4
    pending.finished("p", "r1", now=11.95)  # a second word does not extend it
    pending.settle("p", now=12.0)
    assert pending.pending_blocks("p", h) == 0
    assert pending.counts("p") == PendingCounts(requests=0, blocks=0, withdrawn=0, expired=1)
    pending.withdraw("p", "r1")  # after expiry: nothing left to withdraw
    assert pending.counts("p").withdrawn == 0


def test_a_finished_part_stands_when_the_request_fails_later():
    pending = PendingBlocks()
    h = hashes(family(1))
    pending.add("prefill-0", "r1", h)
    pending.add("decode-0", "r1", h)
    pending.finished("prefill-0", "r1", now=1.0)  # P prefilled; then D failed
    for instance in ("prefill-0", "decode-0"):
        pending.withdraw(instance, "r1")
    assert pending.pending_blocks("prefill-0", h) == 4 and pending.pending_blocks("decode-0", h) == 0


def test_running_requests_never_expire():
    pending = PendingBlocks(grace_s=0.0)
    h = hashes(family(1))
    pending.add("p", "r1", h)
    pending.settle("p", now=1e9)
    assert pending.pending_blocks("p", h) == 4


def test_a_prompt_repeating_a_block_counts_it_once_and_a_key_is_promised_once():
    pending = PendingBlocks()
    h = hashes(family(1))
    pending.add("p", "r1", h + h[:1])
    assert pending.counts("p").blocks == 4
    pending.check_integrity()
    with pytest.raises(AssertionError, match="promised twice"):
        pending.add("p", "r1", h)
    pending.add("p", "r-empty", [])  # a prompt shorter than a block promises nothing
    assert pending.counts("p").requests == 1


def test_a_cleared_cache_voids_finished_promises_made_before_it():
    pending = PendingBlocks()
    h = hashes(family(1))
    pending.add("p", "done", h)
    pending.finished("p", "done", now=1.0, clears=3)
    pending.add("p", "running", hashes(family(2)))
    pending.settle("p", now=1.0, clears=3)  # no clear since: stands
    assert pending.pending_blocks("p", h) == 4
    pending.settle("p", now=1.0, clears=4)
    assert pending.pending_blocks("p", h) == 0 and pending.pending_blocks("p", hashes(family(2))) == 4
    pending.check_integrity()


def test_the_events_confirm_a_finished_promise_and_from_then_on_evictions_count():
    pending = PendingBlocks(grace_s=60.0)
    h = hashes(family(1))
    held: set[bytes] = set()
    pending.add("p", "r1", h)
    pending.settle("p", now=0.5, holds=held.__contains__)  # running: never confirmed early
    pending.finished("p", "r1", now=1.0)
    pending.settle("p", now=1.0, holds=held.__contains__)  # finished, the events not in yet: stands
    assert pending.pending_blocks("p", h) == 4
    held.update(h)  # the BlockStored events arrive
    pending.settle("p", now=1.0, holds=held.__contains__)
    assert pending.counts("p") == PendingCounts(requests=0, blocks=0, withdrawn=0, expired=0, confirmed=1, evicted=0)
    held.clear()  # then evicted: nothing pending claims them any more
    assert pending.pending_blocks("p", h) == 0


def test_a_finished_promise_whose_blocks_came_and_went_between_two_lookups_is_dropped():
    """Under memory pressure the events may store a request's blocks and evict them again before
    the router looks: the promise is over then, not pending until its grace runs out."""
    pending = PendingBlocks(grace_s=60.0)
    h = hashes(family(1))
    removed_at: dict[bytes, int] = {h[0]: 1}  # an earlier copy of its first block went at removal 1

    def evicted(block: bytes, mark: int) -> bool:
        return removed_at.get(block, -1) > mark

    pending.add("p", "r1", h)
    pending.finished("p", "r1", now=1.0, removals=1)
    pending.settle("p", now=1.0, holds=lambda b: False, evicted=evicted)  # nothing removed since: stands
    assert pending.pending_blocks("p", h) == 4
    removed_at[h[-1]] = 2  # its last block stored, then evicted (removal 2)
    pending.settle("p", now=1.0, holds=lambda b: False, evicted=evicted)
    assert pending.pending_blocks("p", h) == 0
    assert pending.counts("p") == PendingCounts(requests=0, blocks=0, withdrawn=0, expired=0, confirmed=0, evicted=1)
    pending.check_integrity()
