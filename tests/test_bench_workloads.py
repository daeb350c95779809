"""cluster/replay/workloads.py: exact prompt structure and exact expected prefix-cache hits.

Every expectation is also checked against an independent simulation of vLLM's
cache (sha256 chained over the generated token blocks, unlimited capacity).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pdcluster.cluster.replay.records import BenchRequest
from pdcluster.cluster.replay.workloads import (
    check_hits,
    family_prefixes,
    hit_ratio_from_tokens,
    load_mooncake,
    prefix_hits_from_tokens,
    read_mooncake,
    seed_protocol,
    synthetic_shared_prefix,
    trace_hit_ratio_from_ids,
)

TRACES = Path("/work/shared/data/traces")
TRACE_FILES = sorted(TRACES.glob("*.jsonl"))
B = 128


def simulated(reqs: list[BenchRequest], block_size: int = B) -> list[int]:
    return list(prefix_hits_from_tokens([r.prompt_token_ids for r in reqs], block_size))


# ---------------------------------------------------------------- synthetic

def test_synthetic_structure_and_expectations():
    kw = {"vocab_size": 1000, "seed": 7}
    reqs = synthetic_shared_prefix(10, 700, 0.5, 16, 3, **kw)
    prefixes = family_prefixes(3, 700, 0.5, **kw)
    assert [r.index for r in reqs] == list(range(10))
    assert [r.family for r in reqs] == [f"prefix-{i % 3}" for i in range(10)]
    assert all(len(p) == 350 for p in prefixes.values())
    assert len({p[0] for p in prefixes.values()}) == 3  # families share no block
    for r in reqs:
        assert len(r.prompt_token_ids) == 700 and r.output_len == 16 and r.phase == "formal"
        assert r.prompt_token_ids[:350] == prefixes[r.family]
        assert all(3 <= t < 1000 for t in r.prompt_token_ids)
    for fam in prefixes:  # suffixes differ from their very first token
        firsts = [r.prompt_token_ids[350] for r in reqs if r.family == fam]
        assert len(set(firsts)) == len(firsts)
    # first of a family: 0; later ones: 350 aligned down to 128 = 256
    assert [r.expected_cached_tokens for r in reqs] == [0, 0, 0] + [256] * 7
    assert simulated(reqs) == [r.expected_cached_tokens for r in reqs]


@pytest.mark.parametrize("input_len,ratio,expect_later", [
    (700, 0.0, 0),       # no shared prefix
    (700, 0.1, 0),       # 70 shared tokens: less than a block
    (512, 0.5, 256),     # prefix exactly 2 blocks
    (640, 1.0, 512),     # identical prompts: capped below the last token (639 // 128 * 128)
    (300, 0.99, 256),    # 297 shared -> 256
    (129, 1.0, 128),
    (128, 1.0, 0),       # one-block prompt: the last token must be computed, so no hit ever
])
def test_synthetic_edge_expectations(input_len, ratio, expect_later):
    reqs = synthetic_shared_prefix(8, input_len, ratio, 4, 2, vocab_size=500, seed=1)
    assert all(len(r.prompt_token_ids) == input_len for r in reqs)
    assert [r.expected_cached_tokens for r in reqs] == [0, 0] + [expect_later] * 6
    assert simulated(reqs) == [r.expected_cached_tokens for r in reqs]
    seeded = synthetic_shared_prefix(8, input_len, ratio, 4, 2, vocab_size=500, seed=1, seeded=True)
    assert [r.expected_cached_tokens for r in seeded] == [expect_later] * 8
    assert [r.prompt_token_ids for r in seeded] == [r.prompt_token_ids for r in reqs]


def test_synthetic_exact_even_with_a_tiny_vocab():
    # 3 usable token ids: random prompts would collide all the time; the distinct
    # first tokens keep every expectation exact.
    reqs = synthetic_shared_prefix(9, 600, 0.5, 4, 3, vocab_size=6, seed=3)
    assert simulated(reqs) == [r.expected_cached_tokens for r in reqs] == [0, 0, 0] + [256] * 6
    with pytest.raises(ValueError):  # a 4th suffix after one prefix cannot start differently
        synthetic_shared_prefix(12, 600, 0.5, 4, 3, vocab_size=6, seed=3)


def test_synthetic_deterministic_per_seed():
    a = synthetic_shared_prefix(6, 400, 0.5, 8, 2, vocab_size=32000, seed=11)
    assert a == synthetic_shared_prefix(6, 400, 0.5, 8, 2, vocab_size=32000, seed=11)
    b = synthetic_shared_prefix(6, 400, 0.5, 8, 2, vocab_size=32000, seed=12)
    assert all(x.prompt_token_ids != y.prompt_token_ids for x, y in zip(a, b))


def test_synthetic_token_range():
    reqs = synthetic_shared_prefix(4, 300, 0.5, 8, 2, vocab_size=1000, seed=0, token_range=(100, 110))
    assert all(100 <= t < 110 for r in reqs for t in r.prompt_token_ids)
    with pytest.raises(ValueError):
        synthetic_shared_prefix(4, 300, 0.5, 8, 2, vocab_size=100, seed=0, token_range=(0, 101))


# ---------------------------------------------------------------- seed protocol

@pytest.mark.parametrize("vocab_size", [32000, 8])  # 8: 5 token ids for 5 suffixes a family
def test_seed_protocol(vocab_size):
    kw = {"vocab_size": vocab_size, "seed": 5}
    formal = synthetic_shared_prefix(6, 500, 0.6, 8, 2, **kw)  # 300 shared -> 256
    prefixes = family_prefixes(2, 500, 0.6, **kw)
    reqs = seed_protocol(formal, prefixes, **kw)
    assert [r.phase for r in reqs] == ["seed"] * 2 + ["check"] * 2 + ["formal"] * 6
    assert [r.index for r in reqs] == list(range(10))
    assert [r.family for r in reqs] == ["prefix-0", "prefix-1"] * 5
    assert [r.expected_cached_tokens for r in reqs] == [0, 0] + [256] * 8
    assert [r.prompt_token_ids for r in reqs[4:]] == [r.prompt_token_ids for r in formal]
    assert all(len(r.prompt_token_ids) == 500 and r.prompt_token_ids[:300] == prefixes[r.family] for r in reqs)
    for fam in prefixes:
        firsts = [r.prompt_token_ids[300] for r in reqs if r.family == fam]
        assert len(set(firsts)) == len(firsts)
    assert simulated(reqs) == [r.expected_cached_tokens for r in reqs]


def test_seed_protocol_rejects_foreign_prefix():
    formal = synthetic_shared_prefix(2, 300, 0.5, 8, 1, vocab_size=1000, seed=1)
    other = family_prefixes(1, 300, 0.5, vocab_size=1000, seed=2)
    with pytest.raises(ValueError):
        seed_protocol(formal, other, vocab_size=1000, seed=1)


def test_check_hits():
    reqs = seed_protocol(synthetic_shared_prefix(3, 300, 0.5, 8, 1, vocab_size=1000, seed=1),
                         family_prefixes(1, 300, 0.5, vocab_size=1000, seed=1), vocab_size=1000, seed=1)
    exact = [(r, r.expected_cached_tokens) for r in reqs]
    assert check_hits(exact) == []
    bad = list(exact)
    bad[1] = (reqs[1], 0)  # the check request missed the cache
    bad[3] = (reqs[3], None)  # the server reported nothing
    msgs = check_hits(bad + [(BenchRequest(99, (1, 2), 1), 5)])  # no expectation: not checked
    assert len(msgs) == 2
    assert "request 1 (check" in msgs[0] and "expected 128" in msgs[0] and "reported 0" in msgs[0]
    assert "request 3 (formal" in msgs[1] and "reported nothing" in msgs[1]


# ---------------------------------------------------------------- Mooncake traces

def write_trace(path: Path, rows: list[tuple[int, int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 7, "hash_ids": ids}) + "\n"
                            for ts, n, ids in rows))
    return path


def test_tiny_trace_exact_hits(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        (0, 1000, [1, 2]),         # cold: 0; caches 896 tokens (id 2: 384 of its 512)
        (500, 1100, [1, 2, 3]),    # id 1 whole + 384 of id 2 = 896
        (1000, 600, [1, 4]),       # id 1 = 512 (cap 599 // 128 * 128 = 512)
        (2000, 1024, [1, 2]),      # whole prompt seen: capped at 1023 // 128 * 128 = 896
        (2500, 300, [5]),          # a partial single block: 0; caches 256
        (3000, 300, [5]),          # 256 (= the cap as well)
    ])
    reqs = load_mooncake(path, vocab_size=1000, seed=0, time_scale=2.0)
    assert [r.expected_cached_tokens for r in reqs] == [0, 896, 512, 896, 0, 256]
    assert simulated(reqs) == [0, 896, 512, 896, 0, 256]
    assert [len(r.prompt_token_ids) for r in reqs] == [1000, 1100, 600, 1024, 300, 300]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    assert all(r.output_len == 7 and r.phase == "formal" for r in reqs)
    # the same trace with a 512-token engine block: partial blocks are never cached
    at512 = load_mooncake(path, engine_block_size=512, vocab_size=1000, seed=0)
    assert [r.expected_cached_tokens for r in at512] == [0, 512, 512, 512, 0, 0] == simulated(at512, 512)
    rows = read_mooncake(path)
    assert trace_hit_ratio_from_ids(rows, 128) == pytest.approx((896 + 512 + 896 + 256) / 4324)


@pytest.mark.parametrize("ids,n", [([1, 2], 1025), ([1, 2], 512), ([], 10)])
def test_trace_rows_that_do_not_fit_their_ids_are_rejected(tmp_path, ids, n):
    with pytest.raises(ValueError, match="does not fit"):
        load_mooncake(write_trace(tmp_path / "bad.jsonl", [(0, n, ids)]), vocab_size=1000, seed=0)


@pytest.fixture(scope="module", params=TRACE_FILES, ids=lambda p: p.stem)
def trace(request):
    path = request.param
    rows = read_mooncake(path, limit=300)
    return path, rows, load_mooncake(path, vocab_size=151936, seed=0, limit=300)


def test_trace_prompts_follow_hash_ids(trace):
    _path, rows, reqs = trace
    assert len(rows) == len(reqs) == 300
    longest: dict[int, tuple[int, ...]] = {}  # id -> its longest block so far
    repeats = 0
    for row, r in zip(rows, reqs):
        assert len(r.prompt_token_ids) == row.input_length and r.output_len == row.output_length
        for j, h in enumerate(row.hash_ids):
            block = r.prompt_token_ids[j * 512:(j + 1) * 512]
            assert 0 < len(block) <= 512
            repeats += h in longest
            short, long = sorted((longest.get(h, ()), block), key=len)
            assert long[:len(short)] == short  # equal ids, equal tokens (a cut last block: its start)
            longest[h] = long
    assert repeats > 100
    assert len({r.prompt_token_ids for r in reqs}) > 1


def test_trace_hits_from_ids_match_token_hashing(trace):
    _, rows, reqs = trace
    prompts = [r.prompt_token_ids for r in reqs]
    from_ids_512 = trace_hit_ratio_from_ids(rows, 512)
    assert from_ids_512 > 0.03  # little sharing this early (whole files: 37% and 65%)
    assert from_ids_512 == hit_ratio_from_tokens(prompts, 512)
    # engine block 128: per request, the expectation equals the simulation
    assert [r.expected_cached_tokens for r in reqs] == list(prefix_hits_from_tokens(prompts, 128))
    assert trace_hit_ratio_from_ids(rows, 128) == hit_ratio_from_tokens(prompts, 128) >= from_ids_512
    # a block size that does not divide 512 still agrees
    assert trace_hit_ratio_from_ids(rows[:100], 96) == hit_ratio_from_tokens(prompts[:100], 96)


def test_trace_arrivals_scale(trace):
    path, rows, reqs = trace
    fast = load_mooncake(path, vocab_size=151936, seed=0, limit=300, time_scale=0.25)
    assert [r.arrival_s for r in reqs] == [row.timestamp_ms / 1000 for row in rows]
    assert reqs[-1].arrival_s > 0
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s * 0.25 for r in reqs])
    assert [r.prompt_token_ids for r in fast] == [r.prompt_token_ids for r in reqs]  # deterministic
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
