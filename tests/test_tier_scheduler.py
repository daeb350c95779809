"""The host tier's scheduler side (transfer/tier_scheduler.py, issue 29): what P's connector asks
its tier as vLLM schedules and ends requests, and the orders it gives the worker, on hand-made
requests (block hashes and token counts as vLLM's Request holds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdcluster.proto.kv_event_wire import BlockRemoved, BlockStored
from pdcluster.transfer.groups import GroupInfo
from pdcluster.transfer.tier_scheduler import TierCopy, TierScheduler

BS = 4  # tokens per block
PAGE = 100  # bytes per block and group


def full(index: int) -> GroupInfo:
    return GroupInfo(index, "full_attention", "FullAttentionSpec", BS, 0, PAGE)


WINDOW = 5  # tokens: a hit of E tokens needs the blocks of tokens [E - 4, E)


def window(index: int) -> GroupInfo:
    return GroupInfo(index, "sliding_window", "SlidingWindowSpec", BS, -(-WINDOW // BS) + 1, PAGE, WINDOW)


@dataclass
class Req:
    """What the tier reads of vLLM's Request."""

    request_id: str
    num_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return list(range(100, 100 + self.num_tokens))

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_tokens


def req(request_id: str, family: str, num_tokens: int) -> Req:
    """A prompt of `num_tokens` whose full blocks hash as `family`'s: prompts of one family share a prefix."""
    return Req(request_id, num_tokens, [f"{family}{i}".encode() for i in range(num_tokens // BS)])


def ended(sched: TierScheduler, r: Req, block_ids, free_after=False, now_s=0.0) -> bool:
    r.num_computed_tokens = r.num_tokens
    return sched.finished(r, block_ids, now_s, free_after=free_after)


def test_an_ended_prompts_full_blocks_are_stored_then_a_later_prompt_loads_them_into_its_own_blocks():
    sched = TierScheduler([full(0)], capacity_bytes=10 * PAGE)
    a = req("a", "f", 13)  # 3 full blocks and 1 token
    assert ended(sched, a, [[7, 8, 9, 10]], free_after=True)
    orders = sched.take_orders()
    assert orders.copies == [TierCopy("store", 0, (b"f0", b"f1", b"f2"), (7, 8, 9), "a")] and orders.free_after == ["a"]

    b = req("b", "f", 13)
    assert sched.lookup(b, 0) == 3 * BS
    sched.allocated(b, [[1, 2, 3, 4]], 3 * BS)
    assert sched.hit_tokens == {"b": 12}
    assert sched.take_orders().copies == [TierCopy("load", 0, (b"f0", b"f1", b"f2"), (1, 2, 3), "b")]
    assert not ended(sched, b, [[1, 2, 3, 4]]) and sched.hit_tokens == {}  # all held: nothing to store


def test_the_hit_starts_past_the_device_caches_and_leaves_one_token_to_compute():
    sched = TierScheduler([full(0)], capacity_bytes=10 * PAGE)
    ended(sched, req("a", "f", 16), [[1, 2, 3, 4]])
    sched.take_orders()
    b = req("b", "f", 16)  # 4 full blocks: the last token is computed, so the 4th block is not a hit
    assert sched.lookup(b, 1 * BS) == 2 * BS
    sched.allocated(b, [[5, 6, 7, 8]], 2 * BS)
    assert sched.take_orders().copies == [TierCopy("load", 0, (b"f1", b"f2"), (6, 7), "b")]
    assert sched.lookup(req("c", "g", 16), 0) == 0  # another family: nothing


def test_every_group_must_hold_a_block_for_it_to_hit_and_each_group_loads_its_own_blocks():
    sched = TierScheduler([full(0), full(1)], capacity_bytes=5 * PAGE)  # 2.5 blocks of both groups
    ended(sched, req("a", "f", 12), [[1, 2, 3], [11, 12, 13]])
    stores = sched.take_orders().copies
    # Kept block by block, in both groups: the 3rd block fits in group 0 only.
    assert stores == [TierCopy("store", 0, (b"f0", b"f1", b"f2"), (1, 2, 3), "a"),
                      TierCopy("store", 1, (b"f0", b"f1"), (11, 12), "a")]
    b = req("b", "f", 13)
    assert sched.lookup(b, 0) == 2 * BS
    sched.allocated(b, [[4, 5, 6, 7], [14, 15, 16, 17]], 2 * BS)
    assert sched.take_orders().copies == [TierCopy("load", 0, (b"f0", b"f1"), (4, 5), "b"),
                                          TierCopy("load", 1, (b"f0", b"f1"), (14, 15), "b")]


def test_a_full_tier_orders_evictions_before_the_stores_that_need_the_room():
    sched = TierScheduler([full(0)], capacity_bytes=3 * PAGE)
    ended(sched, req("a", "f", 12), [[1, 2, 3]])
    ended(sched, req("b", "g", 8), [[4, 5]])
    copies = sched.take_orders().copies
    assert copies[1:] == [TierCopy("evict", 0, (b"f2", b"f1")), TierCopy("store", 0, (b"g0", b"g1"), (4, 5), "b")]
    assert sched.lookup(req("c", "f", 13), 0) == 1 * BS  # f's tail went first: its head still hits


def test_blocks_a_load_reads_are_leased_until_its_order_is_given():
    sched = TierScheduler([full(0)], capacity_bytes=2 * PAGE)
    ended(sched, req("a", "f", 8), [[1, 2]])
    sched.take_orders()
    b = req("b", "f", 9)
    sched.lookup(b, 0)
    sched.allocated(b, [[3, 4, 5]], 2 * BS)
    ended(sched, req("c", "g", 8), [[6, 7]])  # wants the room f holds: refused while f is leased
    assert [c.op for c in sched.take_orders().copies] == ["load"]
    ended(sched, req("d", "g", 8), [[6, 7]])  # the order given, f may go
    assert [c.op for c in sched.take_orders().copies] == ["evict", "store"]


def test_a_request_that_ends_without_its_allocation_or_aborted_leaves_no_state():
    sched = TierScheduler([full(0)], capacity_bytes=4 * PAGE)
    ended(sched, req("a", "f", 8), [[1, 2]])
    sched.take_orders()
    b = req("b", "f", 9)
    assert sched.lookup(b, 0) == 2 * BS  # looked up, never allocated (no room in the device cache)
    sched.forget("b")
    sched.allocated(b, [[3, 4, 5]], 2 * BS)  # a stale allocation orders nothing
    assert sched.take_orders().copies == [] and sched.hit_tokens == {}


def test_a_failed_loads_tokens_are_no_hit_but_counted_apart():
    sched = TierScheduler([full(0)], capacity_bytes=4 * PAGE)
    ended(sched, req("a", "f", 8), [[1, 2]])
    b = req("b", "f", 9)
    sched.lookup(b, 0)
    sched.allocated(b, [[3, 4, 5]], 2 * BS)
    sched.load_failed("b")
    assert (sched.hit_tokens, sched.failed_tokens) == ({}, {"b": 8})
    sched.load_failed("b")  # reported again (a second step's worker): counted once
    assert sched.failed_tokens == {"b": 8}
    ended(sched, b, [[3, 4, 5]])
    assert sched.failed_tokens == {}


def test_blocks_the_worker_lost_are_forgotten():
    sched = TierScheduler([full(0)], capacity_bytes=4 * PAGE)
    ended(sched, req("a", "f", 8), [[1, 2]])
    sched.lost([(0, b"f1")])
    assert sched.lookup(req("b", "f", 12), 0) == 1 * BS


def test_a_requests_retention_hint_keeps_its_blocks_past_newer_ones():
    sched = TierScheduler([full(0)], capacity_bytes=2 * PAGE)
    a = req("a", "f", 4)
    a.kv_transfer_params = {"pdc_retain_s": 600.0}  # the API's kv_retention_s
    ended(sched, a, [[1]], now_s=0)
    ended(sched, req("b", "g", 4), [[2]], now_s=1)
    ended(sched, req("c", "h", 4), [[3]], now_s=2)  # evicts g, newer than f but not retained
    assert [c.hashes for c in sched.take_orders().copies if c.op == "evict"] == [(b"g0",)]
    ended(sched, req("d", "k", 4), [[4]], now_s=601)  # f's retention ran out: LRU again
    assert [c.hashes for c in sched.take_orders().copies if c.op == "evict"] == [(b"f0",)]
    with pytest.raises(ValueError, match="both must be >= 0"):
        TierScheduler([full(0)], capacity_bytes=PAGE, max_retention_s=-1)


def test_only_computed_prompt_blocks_are_kept():
    sched = TierScheduler([full(0)], capacity_bytes=10 * PAGE)
    a = req("a", "f", 12)
    a.num_computed_tokens = 5  # e.g. a chunked prefill that ended early: 1 block is computed
    sched.finished(a, [[1, 2, 3]], 0.0, free_after=False)
    assert sched.take_orders().copies == [TierCopy("store", 0, (b"f0",), (1,), "a")]


def dsv4_like() -> TierScheduler:
    """DeepSeek-V4's shape, scaled down: a compressed group of 16-token blocks, a window group of
    2-token blocks (window 4) and one of 8-token blocks (window 16). vLLM hashes in blocks of 2
    tokens (their gcd) and counts hits in units of 16 (their lcm)."""
    return TierScheduler([GroupInfo(0, "compressed", "MLAAttentionSpec", 16, 0, PAGE),
                          GroupInfo(1, "sliding_window", "SlidingWindowMLASpec", 2, 3, PAGE, 4),
                          GroupInfo(2, "sliding_window", "SlidingWindowMLASpec", 8, 3, PAGE, 16)], 100 * PAGE)


def test_groups_of_several_block_sizes_keep_and_load_each_groups_blocks_by_the_hash_of_the_prefix_it_ends():
    sched = dsv4_like()
    assert (sched.block_size, sched.hash_block_size) == (16, 2)
    a = Req("a", 32, [f"f{i}".encode() for i in range(16)])  # 32 tokens: one hash per 2
    # vLLM had freed the window groups' blocks before their windows (tokens 29-31 and 17-31).
    ended(sched, a, [[1, 2], [0] * 14 + [114, 115], [0, 0, 202, 203]])
    assert sched.take_orders().copies == [TierCopy("store", 0, (b"f7", b"f15"), (1, 2), "a"),
                                          TierCopy("store", 1, (b"f14", b"f15"), (114, 115), "a"),
                                          TierCopy("store", 2, (b"f11", b"f15"), (202, 203), "a")]
    # A longer prompt of the family: a hit of the whole 32 tokens (2 units) needs what was kept.
    b = Req("b", 40, [f"f{i}".encode() for i in range(20)])
    assert sched.lookup(b, 0) == 32
    assert sched.allocated(b, [[5, 6, 7], [0] * 14 + [314, 315, 316, 317], [0, 0, 402, 403, 404]], 32) == 32
    assert sched.take_orders().copies == [TierCopy("load", 0, (b"f7", b"f15"), (5, 6), "b"),
                                          TierCopy("load", 1, (b"f14", b"f15"), (314, 315), "b"),
                                          TierCopy("load", 2, (b"f11", b"f15"), (402, 403), "b")]
    # The prompt resent: a hit may end at 16 only (a token is left to compute), whose windows
    # (blocks 6-7 and 0-1) vLLM had freed: no hit.
    assert sched.lookup(Req("c", 32, [f"f{i}".encode() for i in range(16)]), 0) == 0


def test_a_reset_empties_the_tier_and_orders_its_bytes_freed():
    sched = TierScheduler([full(0)], capacity_bytes=4 * PAGE)
    ended(sched, req("a", "f", 8), [[1, 2]])
    sched.take_orders()
    assert sched.reset() and sched.take_orders().copies == [TierCopy("evict", 0, (b"f1", b"f0"))]
    assert sched.lookup(req("b", "f", 12), 0) == 0 and sched.book.used_bytes == 0


def test_what_the_tier_stores_and_evicts_is_announced_in_runs_with_their_parents():
    sched = TierScheduler([full(0)], capacity_bytes=4 * PAGE)
    a = req("a", "f", 12)
    ended(sched, a, [[1, 2, 3]])
    assert sched.take_events() == [BlockStored([b"f0", b"f1", b"f2"], None, list(range(100, 112)), BS, 0, "CPU")]
    sched.lost([(0, b"f1")])  # a hole: the next prompt of the family stores two runs, each with its parent
    b = req("b", "f", 16)
    ended(sched, b, [[4, 5, 6, 7]])
    assert sched.take_events() == [BlockRemoved((b"f1",), 0, "CPU"),
                                   BlockStored([b"f1"], b"f0", list(range(104, 108)), BS, 0, "CPU"),
                                   BlockStored([b"f3"], b"f2", list(range(112, 116)), BS, 0, "CPU")]
    ended(sched, req("c", "g", 4), [[8]])
    assert sched.take_events() == [BlockRemoved((b"f3",), 0, "CPU"), BlockStored([b"g0"], None, [100, 101, 102, 103],
                                                                                 BS, 0, "CPU")]
    salted = req("d", "h", 4)
    salted.cache_salt = "s"  # its hashes cover the salt, which the router's chain does not: kept, not announced
    sched.reset()
    ended(sched, salted, [[9]])
    assert [type(e) for e in sched.take_events()] == [BlockRemoved]


def test_ps_connector_hands_vllm_the_tiers_events_as_its_own():
    from vllm.distributed import kv_events
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from pdcluster.transfer.connector import PdcConnector

    conn = object.__new__(PdcConnector)
    conn._tier = TierScheduler([full(0)], capacity_bytes=2 * PAGE)
    ended(conn._tier, req("a", "f", 8), [[1, 2]])
    ended(conn._tier, req("b", "g", 4), [[3]])  # evicts f1, a's last
    stored_a, removed, stored_b = conn.take_events()
    assert isinstance(stored_a, kv_events.BlockStored) and isinstance(removed, kv_events.BlockRemoved)
    h = maybe_convert_block_hash  # as vLLM's block pool hands its own hashes out
    assert (stored_a.block_hashes, stored_a.parent_block_hash, stored_a.medium) == ([h(b"f0"), h(b"f1")], None, "CPU")
    assert (removed.block_hashes, removed.medium, stored_b.parent_block_hash) == ([h(b"f1")], "CPU", None)
    assert stored_a.token_ids == list(range(100, 108)) and stored_a.block_size == BS and conn.take_events() == []
    conn._tier = None
    assert conn.take_events() == ()


def hybrid_tier() -> TierScheduler:
    """A full-attention group 0 and a window group 1, holding prompt "f" of 13 tokens as P ends it:
    13 computed, so vLLM had freed the window's blocks 0 and 1 (tokens 0-7: before 13 - 5 + 1)."""
    sched = TierScheduler([full(0), window(1)], capacity_bytes=20 * PAGE)
    ended(sched, req("a", "f", 13), [[1, 2, 3, 4], [0, 0, 23, 24]])
    assert sched.take_orders().copies == [TierCopy("store", 0, (b"f0", b"f1", b"f2"), (1, 2, 3), "a"),
                                          TierCopy("store", 1, (b"f2",), (23,), "a")]
    return sched


def test_a_window_group_keeps_what_its_window_held_and_loads_only_the_blocks_vllm_allocates_in_it():
    sched = hybrid_tier()
    b = req("b", "f", 13)
    assert sched.lookup(b, 0) == 3 * BS  # a hit of 12 tokens: the window needs tokens 8-11, block 2
    # vLLM allocates the window group a block for position 2 only (its null block before it).
    assert sched.allocated(b, [[5, 6, 7, 8], [0, 0, 27, 28]], 3 * BS) == 3 * BS
    assert sched.take_orders().copies == [TierCopy("load", 0, (b"f0", b"f1", b"f2"), (5, 6, 7), "b"),
                                          TierCopy("load", 1, (b"f2",), (27,), "b")]


def test_a_hit_whose_window_blocks_vllm_had_freed_is_cut_back_to_where_the_window_is_held():
    sched = TierScheduler([full(0), window(1)], capacity_bytes=20 * PAGE)
    # D ended it after decoding 4 tokens: 17 computed, the window's blocks 0-2 freed.
    d = req("d", "f", 13)
    d.num_computed_tokens = 17
    sched.finished(d, [[1, 2, 3, 4, 5], [0, 0, 0, 24, 25]], 0.0, free_after=False)
    assert [c.group for c in sched.take_orders().copies] == [0]  # nothing of the window's
    assert sched.lookup(req("b", "f", 13), 0) == 0  # every hit's end needs a window block not held
    # D pulling the rest from P: the window's blocks (2 and 3, for tokens 9-12) come from P, the
    # full group's before them from the tier.
    c = req("c", "f", 13)
    assert sched.lookup(c, 0, computed_to=13) == 2 * BS
    assert sched.allocated(c, [[5, 6, 7, 8], [0, 0, 27, 28]], 2 * BS) == 2 * BS
    assert sched.take_orders().copies == [TierCopy("load", 0, (b"f0", b"f1"), (5, 6), "c")]


def test_a_window_block_vllm_allocates_that_the_lookup_did_not_check_is_loaded_unleased_and_fails_there():
    sched = hybrid_tier()
    b = req("b", "f", 13)
    assert sched.lookup(b, 0) == 3 * BS
    sched.allocated(b, [[5, 6, 7, 8], [0, 26, 27, 28]], 3 * BS)  # (a wider window than the spec's)
    loads = sched.take_orders().copies
    assert loads[1] == TierCopy("load", 1, (b"f1", b"f2"), (26, 27), "b")  # f1: the worker finds no bytes
    assert (1, b"f1") not in sched.book


def test_a_window_groups_blocks_at_each_hit_boundary_the_prefill_passes_are_kept_before_vllm_frees_them():
    sched = dsv4_like()
    a = Req("a", 40, [f"f{i}".encode() for i in range(20)])
    assert sched.lookup(a, 0) == 0 and sched.allocated(a, [[1, 2], list(range(100, 110)), [200, 201, 202]], 0) == 0
    sched.track(a)
    assert sched.prefilling("a")
    # Step 1 computes tokens 0-19, passing the boundary at 16: its windows' blocks 6-7 and 0-1.
    sched.stepped("a", 20, [[1, 2], list(range(100, 110)), [200, 201, 202]])
    assert sched.take_orders().copies == []  # not yet written: the step's forward pass writes them
    a.num_computed_tokens = 20
    sched.written(0.0)
    assert sched.take_orders().copies == [TierCopy("store", 1, (b"f6", b"f7"), (106, 107), "a"),
                                          TierCopy("store", 2, (b"f3", b"f7"), (200, 201), "a")]
    # Step 2 computes 20-39 (vLLM has freed window blocks 0-7 of group 1), passing 32; then a
    # load another request's schedule ordered, which must come after the stores.
    sched.stepped("a", 20, [[1, 2, 3], [0] * 8 + list(range(108, 120)), [200, 201, 202, 203, 204]])
    assert not sched.prefilling("a")
    sched._orders.copies.append(TierCopy("load", 0, (b"g7",), (9,), "other"))
    a.num_computed_tokens = 40
    sched.written(0.0)
    assert sched.take_orders().copies == [TierCopy("store", 1, (b"f14", b"f15"), (114, 115), "a"),
                                          TierCopy("store", 2, (b"f11", b"f15"), (202, 203), "a"),
                                          TierCopy("load", 0, (b"g7",), (9,), "other")]
    ended(sched, a, [[1, 2, 3], [0] * 18 + [118, 119], [0, 0, 0, 203, 204]])
    sched.take_orders()
    # A longer prompt of the family hits all 32 tokens; one sharing only the first 20 hits 16, whose
    # windows the request's end no longer held.
    assert sched.lookup(Req("b", 48, [f"f{i}".encode() for i in range(24)]), 0) == 32
    other = [f"f{i}".encode() for i in range(10)] + [f"x{i}".encode() for i in range(10, 20)]
    assert sched.lookup(Req("c", 40, other), 0) == 16
