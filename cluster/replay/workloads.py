"""Workloads for `pdc bench run`: synthetic shared-prefix families and Mooncake trace replay.

Every request carries the prefix-cache hit its structure implies, computed with
vLLM's rules (engine block size B): only full blocks are cached, a block's hash
chains over all blocks before it, and a hit is at most floor((len - 1) / B) * B
because the engine must compute the last prompt token. The expectations assume
a cold, unlimited cache at the start and that each request's prefill finished
before the next one that relies on it starts (phases run one after the other;
under trace-replay concurrency the expectation is an upper bound).

Token ids come from shake_256 of a key (seed, what, which): stable across
Python/numpy versions and independent of the order things are generated in.
"""

from __future__ import annotations

import hashlib
import json
import operator
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path

import numpy as np

from pdcluster.cluster.replay.records import BenchRequest

TRACE_BLOCK = 512  # Mooncake: one hash id per 512 tokens


# ---------------------------------------------------------------- token ids

@lru_cache(maxsize=4)
def _int_table(lo: int, hi: int) -> tuple[int, ...]:
    # Token lists index into one table, so every prompt shares the same int
    # objects: a prompt costs 8 bytes a token, not 36.
    return tuple(range(lo, hi))


def _tokens(key: tuple, n: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    lo, hi = token_range
    table, span = _int_table(lo, hi), hi - lo
    # Little-endian words, the same ids on every machine; picked from the table in C (a C90
    # load is 10M tokens).
    words = (np.frombuffer(hashlib.shake_256(repr(key).encode()).digest(4 * n), dtype="<u4") % span).tolist()
    return operator.itemgetter(*words)(table) if n > 1 else tuple(table[w] for w in words)


def _token_range(vocab_size: int, token_range: tuple[int, int] | None) -> tuple[int, int]:
    lo, hi = token_range if token_range is not None else (3, vocab_size)  # 0-2: special tokens
    if not 0 <= lo < hi <= vocab_size:
        raise ValueError(f"token_range {lo, hi} must lie in [0, vocab_size={vocab_size})")
    return lo, hi


def _fresh_tokens(key: tuple, n: int, token_range: tuple[int, int], taken: set[int]) -> tuple[int, ...]:
    """n tokens whose first token is not in `taken` (then added to it): two such
    sequences after the same prefix cannot share a single further token, so no
    block past the prefix can ever match by chance."""
    if n and len(taken) >= token_range[1] - token_range[0]:
        raise ValueError("more sequences after one prefix than distinct token ids")
    attempt = 0
    while True:
        toks = _tokens((*key, attempt), n, token_range)
        if not toks or toks[0] not in taken:
            if toks:
                taken.add(toks[0])
            return toks
        attempt += 1


def _prefix_key(family: str, prefix: Sequence[int]) -> object:
    """What a family's suffixes must stay distinct within: its prefix's content. Non-empty
    prefixes of family_prefixes differ (distinct first tokens), so the family's name stands
    for it (hashing a 118K-token prefix per request cost a C90 build a second); empty ones
    are all the same prefix."""
    return family if prefix else ()


def aligned_hit(matched: int, prompt_len: int, block_size: int) -> int:
    """vLLM's hit for a prompt whose first `matched` tokens are in the cache."""
    return min(matched // block_size * block_size, (prompt_len - 1) // block_size * block_size)


# ---------------------------------------------------------------- synthetic families

def family_prefixes(num_prefixes: int, input_len: int, shared_prefix_ratio: float, *, vocab_size: int,
                    seed: int, token_range: tuple[int, int] | None = None) -> dict[str, tuple[int, ...]]:
    """family name -> its prefix of round(input_len * ratio) tokens. Prefixes start
    with distinct tokens, so families never share a block."""
    if not 0.0 <= shared_prefix_ratio <= 1.0 or input_len < 1 or num_prefixes < 1:
        raise ValueError("need 0 <= shared_prefix_ratio <= 1, input_len >= 1, num_prefixes >= 1")
    rng, shared, firsts = _token_range(vocab_size, token_range), round(input_len * shared_prefix_ratio), set()
    return {f"prefix-{k}": _fresh_tokens((seed, "prefix", k), shared, rng, firsts) for k in range(num_prefixes)}


def synthetic_shared_prefix(num_requests: int, input_len: int, shared_prefix_ratio: float, output_len: int,
                            num_prefixes: int, block_size: int = 128, *, vocab_size: int, seed: int,
                            token_range: tuple[int, int] | None = None, seeded: bool = False) -> list[BenchRequest]:
    """num_requests prompts of exactly input_len tokens: family k (round-robin) =
    prefix k + a unique suffix. A family's first request expects 0 cached tokens
    unless `seeded` (the seed protocol ran), every later one the block-aligned prefix."""
    prefixes = family_prefixes(num_prefixes, input_len, shared_prefix_ratio, vocab_size=vocab_size,
                               seed=seed, token_range=token_range)
    rng, names, taken, seen = _token_range(vocab_size, token_range), list(prefixes), {}, set()
    out = []
    for i in range(num_requests):
        fam = names[i % num_prefixes]
        prefix = prefixes[fam]
        # First suffix tokens are kept distinct per prefix *content*: with empty
        # prefixes (ratio 0) all families share the key (), so all prompts differ at 0.
        suffix = _fresh_tokens((seed, "suffix", i), input_len - len(prefix), rng,
                               taken.setdefault(_prefix_key(fam, prefix), set()))
        hit = aligned_hit(len(prefix), input_len, block_size) if seeded or fam in seen else 0
        seen.add(fam)
        out.append(BenchRequest(index=i, prompt_token_ids=prefix + suffix, output_len=output_len,
                                expected_cached_tokens=hit, family=fam))
    return out


def seed_protocol(formal: Sequence[BenchRequest], prefixes: Mapping[str, Sequence[int]], *,
                  block_size: int = 128, vocab_size: int, seed: int,
                  token_range: tuple[int, int] | None = None) -> list[BenchRequest]:
    """Seed phase (one request per family: puts its prefix in the cache, expects 0),
    check phase (one more per family: expects the aligned prefix, proving the cache
    holds it), then `formal` re-expected as seeded. The driver must finish each
    phase before starting the next. Indices are renumbered in this order."""
    fams: dict[str, BenchRequest] = {}  # family -> a formal request (its length, output_len)
    taken: dict[tuple[int, ...], set[int]] = {}
    for r in formal:
        prefix = tuple(prefixes[r.family])
        if r.prompt_token_ids[:len(prefix)] != prefix:
            raise ValueError(f"request {r.index} does not start with the prefix of {r.family}")
        fams.setdefault(r.family, r)
        if len(r.prompt_token_ids) > len(prefix):  # its suffix's first token is taken
            taken.setdefault(_prefix_key(r.family, prefix), set()).add(r.prompt_token_ids[len(prefix)])
    rng = _token_range(vocab_size, token_range)
    out: list[BenchRequest] = []
    for phase in ("seed", "check"):
        for fam, like in fams.items():
            prefix, n = tuple(prefixes[fam]), len(like.prompt_token_ids)
            suffix = _fresh_tokens((seed, phase, fam), n - len(prefix), rng,
                                   taken.setdefault(_prefix_key(fam, prefix), set()))
            hit = 0 if phase == "seed" else aligned_hit(len(prefix), n, block_size)
            out.append(BenchRequest(index=len(out), prompt_token_ids=prefix + suffix, output_len=like.output_len,
                                    expected_cached_tokens=hit, phase=phase, family=fam))
    for r in formal:
        hit = aligned_hit(len(prefixes[r.family]), len(r.prompt_token_ids), block_size)
        out.append(BenchRequest(index=len(out), prompt_token_ids=r.prompt_token_ids, output_len=r.output_len,
                                expected_cached_tokens=hit, arrival_s=r.arrival_s, phase="formal", family=r.family))
    return out


def check_hits(results: Iterable[tuple[BenchRequest, int | None]]) -> list[str]:
    """One message per request whose reported cached_tokens differs from its
    expectation (requests without an expectation are skipped)."""
    bad = []
    for req, cached in results:
        if req.expected_cached_tokens is not None and cached != req.expected_cached_tokens:
            got = "nothing" if cached is None else f"{cached}"
            bad.append(f"request {req.index} ({req.phase}, family {req.family}, {len(req.prompt_token_ids)} tokens): "
                       f"expected {req.expected_cached_tokens} cached tokens, server reported {got}")
    return bad


# ---------------------------------------------------------------- prefix-cache simulation

def prefix_hits_from_tokens(prompts: Iterable[Sequence[int]], block_size: int,
                            stored: Iterable[bool] | None = None) -> Iterator[int]:
    """Per prompt, the hit of an unlimited vLLM-like cache: sha256 chained over full
    blocks, the longest leading run already cached, capped below the last token.
    `stored`: per prompt, whether its blocks then entered the cache (a failed request's
    did not); default: every prompt's did."""
    cache: set[bytes] = set()
    stored = iter(stored) if stored is not None else None
    for p in prompts:
        chain, parent = [], b""
        for end in range(block_size, len(p) + 1, block_size):
            parent = hashlib.sha256(parent + array("i", p[end - block_size:end]).tobytes()).digest()
            chain.append(parent)
        run = 0
        while run < len(chain) and chain[run] in cache:
            run += 1
        yield aligned_hit(run * block_size, len(p), block_size)
        if stored is None or next(stored):
            cache.update(chain)  # the engine caches every full block of the prompt


def hit_ratio_from_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    prompts = list(prompts)
    return sum(prefix_hits_from_tokens(prompts, block_size)) / max(1, sum(map(len, prompts)))


# ---------------------------------------------------------------- Mooncake traces

@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path, *, block_size: int = TRACE_BLOCK, limit: int | None = None) -> list[TraceRow]:
    """The trace's rows (ids only: ~12K rows are a few MB). A row must fill its last
    id's block with 1..block_size tokens (true of every row of the published files);
    anything else cannot be turned into tokens unambiguously, so it is rejected."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(islice((ln for ln in f if ln.strip()), limit), 1):
            d = json.loads(line)
            row = TraceRow(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                           tuple(int(h) for h in d["hash_ids"]))
            if not (len(row.hash_ids) - 1) * block_size < row.input_length <= len(row.hash_ids) * block_size:
                raise ValueError(f"{path}: row {n}: input_length {row.input_length} does not fit "
                                 f"{len(row.hash_ids)} blocks of {block_size}")
            if row.output_length < 1:
                raise ValueError(f"{path}: row {n}: output_length {row.output_length} < 1")
            rows.append(row)
    return rows


def prefix_hits_from_ids(rows: Iterable[TraceRow], cache_block: int, trace_block: int = TRACE_BLOCK) -> Iterator[int]:
    """Per row, the hit of an unlimited cache with block `cache_block`, from the hash
    ids alone. An id stands for its block and every block before it, so all we keep
    is, per id, how many of its tokens some earlier request left in the cache (its
    full cache blocks: a partial last id counts up to the last full block)."""
    covered: dict[int, int] = {}
    for row in rows:
        matched, n = 0, row.input_length
        for i, h in enumerate(row.hash_ids):
            start = i * trace_block
            fill, have = min(trace_block, n - start), covered.get(h, 0)
            matched = start + min(fill, have)
            if have < fill:
                break
        yield aligned_hit(matched, n, cache_block)
        cached_end = n // cache_block * cache_block
        for i, h in enumerate(row.hash_ids):
            have = min(trace_block, cached_end - i * trace_block)
            if have <= 0:
                break
            if covered.get(h, 0) < have:
                covered[h] = have


def trace_hit_ratio_from_ids(rows: Sequence[TraceRow], cache_block: int = TRACE_BLOCK,
                             trace_block: int = TRACE_BLOCK) -> float:
    return sum(prefix_hits_from_ids(rows, cache_block, trace_block)) / max(1, sum(r.input_length for r in rows))


def iter_mooncake(path: str | Path, *, block_size: int = TRACE_BLOCK, engine_block_size: int = 128, vocab_size: int,
                  seed: int, limit: int | None = None, time_scale: float = 1.0,
                  token_range: tuple[int, int] | None = None) -> Iterator[BenchRequest]:
    """The trace as requests, built one at a time (a whole file is ~150M tokens).
    Hash id h -> the block of tokens keyed (seed, h), the last block cut to
    input_length; arrival_s = timestamp / 1000 * time_scale (0.5: twice as fast)."""
    rng, rows = _token_range(vocab_size, token_range), read_mooncake(path, block_size=block_size, limit=limit)
    block = lru_cache(maxsize=4096)(lambda h: _tokens((seed, "block", h), block_size, rng))  # hot prefixes recur
    hits = prefix_hits_from_ids(rows, engine_block_size, block_size)
    for i, (row, hit) in enumerate(zip(rows, hits)):
        prompt: list[int] = []
        for h in row.hash_ids:
            prompt.extend(block(h))
        yield BenchRequest(index=i, prompt_token_ids=tuple(prompt[:row.input_length]), output_len=row.output_length,
                           expected_cached_tokens=hit, arrival_s=row.timestamp_ms / 1000 * time_scale)


def load_mooncake(path: str | Path, block_size: int = TRACE_BLOCK, engine_block_size: int = 128, *, vocab_size: int,
                  seed: int, limit: int | None = None, time_scale: float = 1.0,
                  token_range: tuple[int, int] | None = None) -> list[BenchRequest]:
    return list(iter_mooncake(path, block_size=block_size, engine_block_size=engine_block_size, vocab_size=vocab_size,
                              seed=seed, limit=limit, time_scale=time_scale, token_range=token_range))
