"""The router's per-instance prefix index (router/prefix_index.py), fed hand-made vLLM-style events."""

from __future__ import annotations

import time

import pytest

from pdcluster.proto.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored
from pdcluster.proto.kv_groups import KvGroup
from pdcluster.router.prefix_index import ROOT, InstanceIndex, block_hash, chain_hashes, hittable_hashes

BS = 4
PROMPT = list(range(100, 114))  # 3 full blocks + 2 tokens
PINNED_FIRST = "d8faa8ec8c050056"  # block_hash(ROOT, [1, 2, 3, 4]) as first committed (sha256 over uint32 LE)


def stored(engine_hashes, parent, tokens):
    return BlockStored(tuple(engine_hashes), parent, tuple(tokens), BS)


def test_chain_hashes_cover_full_blocks_and_chain_parents():
    hashes = chain_hashes(PROMPT, BS)
    assert len(hashes) == 3
    assert hashes[0] == block_hash(ROOT, PROMPT[:4]) and hashes[1] == block_hash(hashes[0], PROMPT[4:8])
    # Same tokens after a different first block: a different hash (the history differs).
    other = [7] + PROMPT[1:]
    assert chain_hashes(other, BS)[1] != hashes[1]


def test_stored_blocks_are_matched_as_a_prefix():
    idx = InstanceIndex(BS)
    assert idx.apply(0, [stored([11, 12], None, PROMPT[:8])])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 2
    # The third block, stored later under its engine parent 12.
    assert idx.apply(1, [stored([13], 12, PROMPT[8:12])])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 3
    assert idx.matched_blocks(chain_hashes([9] + PROMPT[1:], BS)) == 0


def test_removed_block_breaks_the_prefix_there():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11, 12, 13], None, PROMPT[:12])])
    idx.apply(1, [BlockRemoved((12,))])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 1
    assert (len(idx), idx.removed_blocks) == (2, 1)
    idx.apply(2, [BlockRemoved((12, 99))])  # gone already, and never held: nothing more removed
    assert (len(idx), idx.removed_blocks) == (2, 1)


def test_the_index_remembers_when_each_block_went():
    idx = InstanceIndex(BS)
    hashes = chain_hashes(PROMPT, BS)
    idx.apply(0, [stored([11, 12, 13], None, PROMPT[:12])])
    mark = idx.removed_blocks
    assert not idx.removed_since(hashes[2], mark)
    idx.apply(1, [BlockRemoved((13,))])
    assert idx.removed_since(hashes[2], mark) and not idx.removed_since(hashes[2], idx.removed_blocks)
    assert not idx.removed_since(hashes[1], mark)  # still held


def test_unknown_parent_is_not_guessed():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([13], 99, PROMPT[8:12])])
    assert len(idx) == 0


def test_clear_event_empties_the_index():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11], None, PROMPT[:4]), AllBlocksCleared()])
    assert len(idx) == 0 and idx.matched_blocks(chain_hashes(PROMPT, BS)) == 0


def test_missed_batch_clears_and_marks_stale_then_learns_again():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11], None, PROMPT[:4])])
    assert not idx.apply(2, [stored([21], None, PROMPT[:4])])  # batch 1 never came
    # Cleared at the gap, then the revealing batch applied: what it says is true.
    assert idx.stale and len(idx) == 1 and idx.next_seq == 3
    assert idx.apply(3, [stored([22], 21, PROMPT[4:8])])
    assert idx.stale and idx.matched_blocks(chain_hashes(PROMPT, BS)) == 2


def test_cache_cleared_or_restart_ends_staleness():
    idx = InstanceIndex(BS)
    idx.lost_history()
    idx.apply(5, [AllBlocksCleared()])
    assert not idx.stale
    idx.lost_history()
    idx.apply(6, [stored([11], None, PROMPT[:4])])
    idx.restarted()
    assert (idx.stale, len(idx), idx.next_seq) == (False, 0, None)


def test_same_prefix_stored_twice_counts_both_blocks():
    # Two engine blocks with the same content (e.g. recomputed): removing one keeps the prefix.
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11], None, PROMPT[:4]), stored([21], None, PROMPT[:4])])
    idx.apply(1, [BlockRemoved((11,))])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 1


def test_a_block_announced_again_is_held_once():
    # vLLM announces a hit block again in "full" mode, alone or among new blocks: held once each.
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11, 12], None, PROMPT[:8])])
    idx.apply(1, [stored([11, 12, 13], None, PROMPT[:12]), stored([12], 11, PROMPT[4:8])])
    assert (len(idx), idx.matched_blocks(chain_hashes(PROMPT, BS))) == (3, 3)
    idx.apply(2, [BlockRemoved((12,))])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 1  # the one copy of block 1 is gone


def test_known_hashes_are_taken_and_the_rest_hashed_from_them():
    # The virtual clock passes the router hashes it worked out for the engine's (`known`): a
    # block not among them is hashed from its tokens, chained to the known one before it.
    hashes = chain_hashes(PROMPT, BS)
    idx = InstanceIndex(BS, known={11: hashes[0], 13: hashes[2]})
    idx.apply(0, [stored([11, 12, 13], None, PROMPT[:12])])
    assert idx.matched_blocks(hashes) == 3 and idx._held[0] == dict(zip([11, 12, 13], hashes))
    # Known hashes name the block, whatever the event says its tokens are.
    wrong = InstanceIndex(BS, known={21: hashes[0]})
    wrong.apply(0, [stored([21], None, [0, 0, 0, 0])])
    assert wrong.matched_blocks(hashes) == 1


def test_blocks_of_another_size_or_medium_are_skipped_and_counted():
    idx = InstanceIndex(BS)
    idx.apply(0, [BlockStored((1,), None, tuple(range(8)), 8),  # a hybrid model's other block size
                  BlockStored((2,), None, tuple(PROMPT[:4]), BS, medium="DISK"),  # a tier the router does not price
                  BlockRemoved((2,), medium="DISK")])
    assert len(idx) == 0 and idx.skipped_events == 3


def test_a_host_tiers_blocks_are_held_apart_and_continue_the_devices_run():
    idx = InstanceIndex(BS)
    hashes = chain_hashes(PROMPT, BS)  # 3 full blocks
    idx.apply(0, [BlockStored((11, 12, 13), None, tuple(PROMPT[:12]), BS, medium="CPU"),  # the tier: all three
                  BlockStored((11,), None, tuple(PROMPT[:4]), BS)])  # the device: the first
    assert (idx.matched_blocks(hashes), idx.tier_matched_blocks(hashes, 1), len(idx)) == (1, 2, 1)
    # A tier run may hang off a device block: its parent's router hash comes from the device's index.
    other = InstanceIndex(BS)
    other.apply(0, [BlockStored((11,), None, tuple(PROMPT[:4]), BS),
                    BlockStored((12, 13), 11, tuple(PROMPT[4:12]), BS, medium="CPU")])
    assert (other.matched_blocks(hashes), other.tier_matched_blocks(hashes, 1)) == (1, 2)
    other.apply(1, [BlockRemoved((12,), medium="CPU")])  # evicted from the tier: its run ends before it
    assert other.tier_matched_blocks(hashes, 1) == 0 and other.matched_blocks(hashes) == 1
    idx.apply(1, [AllBlocksCleared()])  # a reset: the device and the tier
    assert (idx.matched_blocks(hashes), idx.tier_matched_blocks(hashes, 0)) == (0, 0)
    assert InstanceIndex(BS).tier_matched_blocks(hashes, 0) == 0  # no tier at all


def test_groups_are_kept_apart():
    # A hybrid model stores one engine hash per group; a removal in group 1 keeps group 0's.
    idx = InstanceIndex(BS)
    idx.apply(0, [BlockStored((11,), None, tuple(PROMPT[:4]), BS, group_idx=0),
                  BlockStored((11,), None, tuple(PROMPT[:4]), BS, group_idx=1),
                  BlockRemoved((11,), group_idx=1)])
    hashes = chain_hashes(PROMPT, BS)
    assert (idx.matched_blocks(hashes, group=0), idx.matched_blocks(hashes, group=1)) == (1, 0)


LONG = list(range(100, 125))  # 6 full blocks + 1 token
WINDOW = 5  # tokens: a hit of E tokens needs the window group's blocks of tokens [E - 4, E)


def hybrid_index() -> InstanceIndex:
    """Group 0 a sliding window (as vLLM orders Gemma3's and gpt-oss's groups), group 1 full attention."""
    return InstanceIndex(BS, groups=(KvGroup("sliding_window", BS, WINDOW), KvGroup("full_attention", BS)))


def test_a_hybrid_models_hit_is_the_full_groups_run_cut_back_to_where_the_window_is_held():
    idx, hashes = hybrid_index(), chain_hashes(LONG, BS)
    engine = [11, 12, 13, 14, 15, 16]
    idx.apply(0, [BlockStored(tuple(engine), None, tuple(LONG[:24]), BS, group_idx=g) for g in (0, 1)])
    assert idx.matched_blocks(hashes) == 6
    # The engine evicts the window group's first blocks (freed first, as the window slid past them):
    # the hit is the same, as vLLM counts it, though group 0's run from the start is gone.
    idx.apply(1, [BlockRemoved((11, 12, 13), group_idx=0)])
    assert (idx.matched_blocks(hashes), idx.matched_blocks(hashes, group=0)) == (6, 0)
    # The window's block at the end gone: the hit ends where the window before it is held.
    idx.apply(2, [BlockRemoved((16,), group_idx=0)])  # block 5 (tokens 20-23), which a hit of 24 needs
    assert idx.matched_blocks(hashes) == 5  # 20 tokens: the window needs tokens 16-19, block 4
    idx.apply(3, [BlockRemoved((15, 14), group_idx=0)])  # blocks 4 and 3: no end before them is held
    assert idx.matched_blocks(hashes) == 0
    assert idx.holds(hashes[2]) and not idx.holds(hashes[2], group=0)  # the full group's, by default


def test_a_window_groups_blocks_stored_after_their_parent_left_it_are_placed_by_another_groups():
    idx, hashes = hybrid_index(), chain_hashes(LONG, BS)
    idx.apply(0, [BlockStored((11, 12), None, tuple(LONG[:8]), BS, group_idx=g) for g in (0, 1)])
    idx.apply(1, [BlockRemoved((11, 12), group_idx=0)])
    # A later request computes blocks 2-3: the window group's parent (12) is the full group's only.
    idx.apply(2, [BlockStored((13, 14), 12, tuple(LONG[8:16]), BS, group_idx=g) for g in (0, 1)])
    assert idx.matched_blocks(hashes) == 4 and idx.holds(hashes[3], group=0)


def test_a_window_groups_blocks_announced_before_their_parents_group_are_placed_once_it_is():
    """vLLM announces a hybrid model's groups in its order, the window group first: its blocks may
    name a parent that a later event of the same batch brings (a tier's, or a load's)."""
    idx, hashes = hybrid_index(), chain_hashes(LONG, BS)
    idx.apply(0, [BlockStored((16,), 15, tuple(LONG[20:24]), BS, group_idx=0, medium="CPU"),
                  BlockStored((11, 12, 13, 14, 15, 16), None, tuple(LONG[:24]), BS, group_idx=1, medium="CPU")])
    assert idx.tier_matched_blocks(hashes, 0) == 6
    # One removed in the batch before its parent came is never placed.
    idx.apply(1, [BlockStored((26,), 25, tuple(range(20, 24)), BS, group_idx=0, medium="CPU"),
                  BlockRemoved((26,), group_idx=0, medium="CPU"),
                  BlockStored((25,), None, tuple(range(16, 20)), BS, group_idx=1, medium="CPU"),
                  BlockStored((26,), 25, tuple(range(20, 24)), BS, group_idx=1, medium="CPU")])
    assert 26 not in idx.host._held[0] and 26 in idx.host._held[1]


def test_a_window_groups_event_that_leaves_out_the_blocks_vllm_freed_places_the_rest():
    """vLLM's window-group event names only the blocks it did not free (a prefill of the whole
    prompt in one step frees the window's older ones before caching), with the whole range's
    tokens: they are its last blocks."""
    idx, hashes = hybrid_index(), chain_hashes(LONG, BS)
    idx.apply(0, [BlockStored((16,), None, tuple(LONG[:24]), BS, group_idx=0),
                  BlockStored((11, 12, 13, 14, 15, 16), None, tuple(LONG[:24]), BS, group_idx=1)])
    assert idx.matched_blocks(hashes) == 6 and idx.holds(hashes[5], group=0)
    assert not idx.holds(hashes[4], group=0) and idx.skipped_events == 0
    # An index that does not know the group for a window's: the event is skipped, the batch applies.
    plain = InstanceIndex(BS)
    assert plain.apply(0, [BlockStored((16,), None, tuple(LONG[:24]), BS), BlockStored((21,), None, tuple(LONG[:4]), BS)])
    assert (plain.skipped_events, plain.matched_blocks(hashes)) == (1, 1)


def test_a_hybrid_tiers_run_counts_its_window_blocks_past_the_devices_hit():
    idx, hashes = hybrid_index(), chain_hashes(LONG, BS)
    idx.apply(0, [BlockStored((11,), None, tuple(LONG[:4]), BS, group_idx=g) for g in (0, 1)])
    # The tier kept blocks 1-5 of the full group and, of the window group, what its window held.
    idx.apply(1, [BlockStored((12, 13, 14, 15, 16), 11, tuple(LONG[4:24]), BS, group_idx=1, medium="CPU"),
                  BlockStored((16,), 15, tuple(LONG[20:24]), BS, group_idx=0, medium="CPU")])
    assert idx.matched_blocks(hashes) == 1
    assert idx.tier_matched_blocks(hashes, 1) == 5  # 24 tokens: the window needs block 5 (tokens 20-23)
    idx.apply(2, [BlockRemoved((16,), group_idx=0, medium="CPU")])
    assert idx.tier_matched_blocks(hashes, 1) == 0


def test_groups_of_other_block_sizes_leave_the_hit_to_group_0():
    idx = InstanceIndex(BS, groups=(KvGroup("full_attention", BS), KvGroup("compressed", 4 * BS)))
    idx.apply(0, [BlockStored((11, 12), None, tuple(PROMPT[:8]), BS)])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 2


def test_extra_keys_make_a_different_block():
    # A salted (or LoRA) block holds other KV than the plain prompt's: it must not match it.
    idx = InstanceIndex(BS)
    idx.apply(0, [BlockStored((11,), None, tuple(PROMPT[:4]), BS, extra_keys=(("salt",),))])
    assert len(idx) == 1 and idx.matched_blocks(chain_hashes(PROMPT, BS)) == 0


def test_tokens_not_matching_hashes_assert():
    with pytest.raises(AssertionError, match="mis-reads the event"):
        InstanceIndex(BS).apply(0, [BlockStored((1, 2), None, tuple(range(4)), BS)])


def test_hash_values_are_pinned():
    # The router's hashes must not change between versions (a sim or a saved trace relies on them).
    assert block_hash(ROOT, [1, 2, 3, 4]).hex()[:16] == PINNED_FIRST
    assert chain_hashes(list(range(8)), BS)[1] == block_hash(block_hash(ROOT, range(4)), range(4, 8))


def test_hittable_hashes_leave_the_last_token_to_compute():
    assert hittable_hashes(PROMPT[:12], BS) == chain_hashes(PROMPT, BS)[:2]  # 12 tokens: 2 blocks hittable
    assert hittable_hashes(PROMPT[:13], BS) == chain_hashes(PROMPT, BS)[:3]
    assert hittable_hashes([], BS) == []
    assert [len(hittable_hashes(list(range(n)), 4)) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_token_out_of_range_is_an_error():
    with pytest.raises(OverflowError):
        chain_hashes([-1, 0, 0, 0], BS)


def test_long_prompt_hashes_in_a_few_ms():
    tokens = list(range(131_072))
    chain_hashes(tokens, 128)  # warm
    t0 = time.perf_counter()
    hashes = chain_hashes(tokens, 128)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert len(hashes) == 1024
    assert elapsed_ms < 20, f"{elapsed_ms:.1f} ms for 1,024 blocks: chain_hashes lost its one-conversion path"
