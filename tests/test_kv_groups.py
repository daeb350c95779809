"""The hit rule of hybrid models (proto/kv_groups.py), on hand-made holdings."""

from pdcluster.proto.kv_groups import (
    block_hash_index,
    cut_to_windows,
    hash_block_size,
    hit_unit,
    window_blocks,
    window_first_block,
)

BS = 4


def holder(blocks: dict[int, set[int]]):
    return lambda g, i: i in blocks.get(g, set())


def test_window_first_block_is_the_block_of_the_windows_first_token():
    assert window_first_block(16, BS, 8) == 2  # tokens 9..15: blocks 2 and 3
    assert window_first_block(16, BS, 9) == 2  # tokens 8..15
    assert window_first_block(16, BS, 10) == 1  # tokens 7..15
    assert window_first_block(3, BS, 8) == 0


def test_window_blocks_count_from_the_later_of_the_runs_end_and_computed_to():
    assert window_blocks(0, 16, BS, 8) == range(2, 4)
    assert window_blocks(12, 16, BS, 8) == range(3, 4)  # blocks before start are the caller's
    assert window_blocks(0, 16, BS, 8, computed_to=40) == range(4, 4)  # D pulls the window's tail from P
    assert window_blocks(0, 256, 8, 128) == range(16, 32)  # a group of smaller blocks than the run's unit


def test_a_run_is_cut_back_until_every_window_group_holds_its_window():
    windows = [(1, 8, BS)]
    assert cut_to_windows(4, 0, BS, windows, holder({1: {2, 3}})) == 4
    # Without block 3 the hit ends where the window's blocks before it are held: 3 blocks need 1, 2.
    assert cut_to_windows(4, 0, BS, windows, holder({1: {1, 2}})) == 3
    assert cut_to_windows(4, 0, BS, windows, holder({1: set()})) == 0
    assert cut_to_windows(4, 0, BS, [], holder({})) == 4  # no window group: the full groups' run


def test_with_computed_to_later_only_the_blocks_in_the_final_window_are_needed():
    # Prompt of 40 tokens: the window (8) lies past the run, so no window block is needed.
    assert cut_to_windows(4, 0, BS, [(1, 8, BS)], holder({}), computed_to=40) == 4
    # Prompt of 18 tokens: tokens 11..17 are in the window, of the run's blocks only block 2 and 3.
    assert cut_to_windows(4, 0, BS, [(1, 8, BS)], holder({1: {3}}), computed_to=18) == 2


def test_groups_of_other_block_sizes_are_counted_in_their_own_blocks():
    # DeepSeek-V4's shape: a unit of 16 tokens; a window group of 2-token blocks (window 4) and one
    # of 8-token blocks (window 16). Two units (32 tokens) need blocks 14, 15 and 2, 3.
    windows = [(1, 4, 2), (2, 16, 8)]
    assert cut_to_windows(2, 0, 16, windows, holder({1: {14, 15}, 2: {2, 3}})) == 2
    # Without block 15, one unit: its windows' blocks 6, 7 and 0, 1 (none held: no hit).
    assert cut_to_windows(2, 0, 16, windows, holder({1: {6, 7, 14}, 2: {0, 1, 2, 3}})) == 1
    # From token 16, two units would end at 48 (blocks 22, 23 not held): one.
    assert cut_to_windows(2, 16, 16, windows, holder({1: {14, 15}, 2: {2, 3}})) == 1


def test_vllms_hash_granularity_hit_unit_and_block_names_for_groups_of_several_block_sizes():
    sizes = (256, 4, 64, 8)  # DeepSeek-V4's
    assert (hash_block_size(sizes), hit_unit(sizes)) == (4, 256)
    assert (hash_block_size([128]), hit_unit([128])) == (128, 128)
    # Block 1 of a 64-token group ends at token 128: the 32nd hash of 4 tokens names it.
    assert block_hash_index(1, 64, 4) == 31 and block_hash_index(0, 4, 4) == 0
