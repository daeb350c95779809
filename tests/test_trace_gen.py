"""bench/trace_gen.py: prefix-family traces in the Mooncake format."""

from __future__ import annotations

import pytest

from pdcluster.bench.trace_gen import FamilyTrace, write
from pdcluster.cluster.replay.workloads import TRACE_BLOCK, load_mooncake, read_mooncake, trace_hit_ratio_from_ids


def test_families_share_their_history_and_nothing_else(tmp_path):
    trace = FamilyTrace(families=3, requests=30, rate=5.0, input_len=4 * TRACE_BLOCK + 100,
                        shared_tokens=3 * TRACE_BLOCK, output_len=2, seed=1)
    rows = trace.rows()
    assert len(rows) == 30 and [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    histories = {r.hash_ids[:3] for r in rows}
    assert 1 < len(histories) <= 3
    own = [i for r in rows for i in r.hash_ids[3:]]
    assert len(own) == len(set(own)) == 30 * 2  # 2 blocks of its own each (the last one partial)
    # Structural maximum: every request but each family's first hits its 3 shared blocks.
    want = (30 - len(histories)) * 3 * TRACE_BLOCK / (30 * trace.input_len)
    assert trace_hit_ratio_from_ids(rows, 128) == pytest.approx(want)
    write(rows, tmp_path / "t.jsonl")
    assert read_mooncake(tmp_path / "t.jsonl") == rows
    assert len(load_mooncake(tmp_path / "t.jsonl", vocab_size=1000, seed=0)) == 30  # it replays


@pytest.mark.parametrize("field, value, message", [
    ("shared_tokens", 100, "a multiple of 512"), ("shared_tokens", 5 * TRACE_BLOCK, "below input_len"),
    ("rate", 0.0, "must be positive"), ("families", 0, "must be at least 1"),
])
def test_bad_parameters_are_named(field, value, message):
    base = dict(families=2, requests=4, rate=1.0, input_len=4 * TRACE_BLOCK, shared_tokens=2 * TRACE_BLOCK,
                output_len=1)
    with pytest.raises(ValueError, match=message):
        FamilyTrace(**{**base, field: value})
