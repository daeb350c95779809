"""The router's per-instance prefix index (router/prefix_index.py), fed hand-made vLLM-style events."""

from __future__ import annotations

import pytest

from pdcluster.router.prefix_index import (
    ROOT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InstanceIndex,
    block_hash,
    chain_hashes,
)

BS = 4
PROMPT = list(range(100, 114))  # 3 full blocks + 2 tokens


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
    assert len(idx) == 2


def test_unknown_parent_is_not_guessed():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([13], 99, PROMPT[8:12])])
    assert len(idx) == 0


def test_clear_event_empties_the_index():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11], None, PROMPT[:4]), AllBlocksCleared()])
    assert len(idx) == 0 and idx.matched_blocks(chain_hashes(PROMPT, BS)) == 0


def test_missed_batch_clears_and_marks_stale_until_resync():
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11], None, PROMPT[:4])])
    assert not idx.apply(2, [stored([12], 11, PROMPT[4:8])])  # batch 1 never came
    assert idx.stale and len(idx) == 0
    assert idx.apply(3, [])  # numbering continues from the batch that revealed the gap
    idx.resynced()
    assert not idx.stale


def test_same_prefix_stored_twice_counts_both_blocks():
    # Two engine blocks with the same content (e.g. recomputed): removing one keeps the prefix.
    idx = InstanceIndex(BS)
    idx.apply(0, [stored([11], None, PROMPT[:4]), stored([21], None, PROMPT[:4])])
    idx.apply(1, [BlockRemoved((11,))])
    assert idx.matched_blocks(chain_hashes(PROMPT, BS)) == 1


def test_block_size_mismatch_asserts():
    with pytest.raises(AssertionError, match="mismatched config"):
        InstanceIndex(BS).apply(0, [BlockStored((1,), None, tuple(range(8)), 8)])
