"""A KV tier's book (transfer/tier_book.py, issue 29): keep, evict, match, lease, retention, on
hand-made blocks."""

from __future__ import annotations

import pytest

from pdcluster.transfer.tier_book import Kept, TierBook


def blocks(*names: str, group: int = 0, nbytes: int = 10) -> list[tuple[tuple[int, bytes], int]]:
    return [((group, n.encode()), nbytes) for n in names]


def key(name: str, group: int = 0) -> tuple[int, bytes]:
    return group, name.encode()


def test_blocks_are_kept_until_full_then_the_least_recently_used_go_first():
    book = TierBook(capacity_bytes=30)
    book.keep(blocks("a"), now_s=0)
    book.keep(blocks("b"), now_s=0)
    assert book.keep(blocks("c"), now_s=0) == Kept((key("c"),))
    assert book.match({0: [b"a"]}) == 1  # a used again: b is now the oldest
    kept = book.keep(blocks("d"), now_s=1)
    assert kept == Kept((key("d"),), (key("b"),)) and book.used_bytes == 30 and key("b") not in book


def test_of_a_prompts_blocks_the_last_goes_first_and_its_first_last():
    book = TierBook(capacity_bytes=40)
    book.keep(blocks("a", "b", "c"), now_s=0)  # one prompt: its tail is worth least (it never hits alone)
    assert book.keep(blocks("x", "y"), now_s=1) == Kept((key("x"), key("y")), (key("c"),))
    assert book.match({0: [b"a", b"b"]}) == 2  # used again, head last: then x's tail, y, is the oldest
    assert book.keep(blocks("z"), now_s=2) == Kept((key("z"),), (key("y"),))


def test_a_prompts_earlier_blocks_are_not_evicted_for_its_later_ones_and_the_rest_is_refused():
    book = TierBook(capacity_bytes=30)
    kept = book.keep(blocks("a", "b", "c", "d"), now_s=0)
    # d would evict a, the prompt's own first block: a chain with a hole never hits, so d is refused.
    assert kept == Kept((key("a"), key("b"), key("c")), (), (key("d"),))


def test_the_longest_prefix_held_in_every_group_is_the_hit():
    book = TierBook(capacity_bytes=100)
    book.keep(blocks("a", "b", "c") + blocks("a", "b", group=1), now_s=0)
    assert book.match({0: [b"a", b"b", b"c"]}) == 3
    assert book.match({0: [b"a", b"b", b"c"], 1: [b"a", b"b", b"c"]}) == 2  # group 1 lacks c
    assert book.match({0: [b"x", b"b"]}) == 0  # no hit past a missing first block
    assert book.match({}) == 0


def test_a_leased_block_is_never_evicted_and_a_full_tier_refuses_instead():
    book = TierBook(capacity_bytes=20)
    book.keep(blocks("a", "b"), now_s=0)
    lease = book.lease([key("a"), key("b")])
    assert book.keep(blocks("c"), now_s=1) == Kept((), (), (key("c"),))
    assert book.drop([key("a")]) == ()  # nor dropped while read
    book.release(lease)
    book.release(lease)  # twice: a no-op
    assert book.keep(blocks("c"), now_s=2) == Kept((key("c"),), (key("b"),))  # a's prompt's tail first
    with pytest.raises(KeyError, match="does not hold 1 of the 2 blocks"):
        book.lease([key("b"), key("a")])


def test_retained_blocks_go_after_the_others_and_their_retention_is_bounded():
    book = TierBook(capacity_bytes=30, max_retention_s=100)
    book.keep(blocks("s1"), now_s=0, retain_s=1000)  # a session's prefix: kept up to 100 s
    book.keep(blocks("x", "y"), now_s=1)
    assert book.keep(blocks("z"), now_s=2).evicted == (key("y"),)  # y is newer than s1 but not retained
    assert book.keep(blocks("w"), now_s=3).evicted == (key("x"),)
    assert book.keep(blocks("v"), now_s=101).evicted == (key("s1"),)  # 100 s on, its retention ran out


def test_among_retained_blocks_the_soonest_to_expire_goes_first():
    book = TierBook(capacity_bytes=20, max_retention_s=100)
    book.keep(blocks("long"), now_s=0, retain_s=50)
    book.keep(blocks("short"), now_s=0, retain_s=10)
    assert book.keep(blocks("new"), now_s=1).evicted == (key("short"),)


def test_a_block_bigger_than_the_tier_is_refused_and_sizes_are_checked():
    assert TierBook(capacity_bytes=5).keep(blocks("a"), now_s=0) == Kept((), (), (key("a"),))
    with pytest.raises(ValueError, match="must be >= 0"):
        TierBook(capacity_bytes=-1)


def test_dropped_blocks_free_their_bytes():
    book = TierBook(capacity_bytes=30)
    book.keep(blocks("a", "b"), now_s=0)
    assert book.drop([key("a"), key("zz")]) == (key("a"),) and book.used_bytes == 10 and len(book) == 1
