"""A load's prompts, hashed once: what every instance and the router would each work out again.

A 131,076-token prompt costs ~4 ms of vLLM block hashes (the pools' keys, block_pool.py),
~3.5 ms of the router's (router/prefix_index.py) and ~3 ms for its id range; C90's 672
prompts, hashed by P, D and the router, would take ~10 s. Here each prompt is hashed once,
with the same functions, and a prefix family's shared part once per family: requests of
one `family` (bench/workloads.py builds them as its prefix + their own suffix) start with
the same tokens, as long as the first two members do (checked exactly), and each later
member's first and last shared block are checked against them too. A prepared prompt is
kept by the request's place in the load, so a sweep over cluster configurations
(`pdc plan`) hashes the load once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.bench.records import BenchRequest
from pdcluster.cluster.sim.block_pool import hash_blocks
from pdcluster.cluster.sim.kv_wire import external_hashes
from pdcluster.router.prefix_index import RouterHash, hittable_hashes


@dataclass(frozen=True)
class PreparedPrompt:
    tokens: tuple[int, ...]
    block_hashes: list[bytes]  # vLLM's, every full block (SimRequest.block_hashes)
    router_hashes: list[RouterHash]  # the router's, every hittable block (InstancePicker.pick)
    id_range: tuple[int, int]


@dataclass
class _Family:
    first: PreparedPrompt
    shared: int | None = None  # tokens every member shares with the first; None: one member seen
    shared_range: tuple[int, int] = (0, 0)


def _id_range(tokens: tuple[int, ...]) -> tuple[int, int]:
    return (min(tokens), max(tokens)) if tokens else (0, 0)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix (binary search over slices compared in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._families: dict[str, _Family] = {}
        self._prepared: dict[tuple[str, int], PreparedPrompt] = {}
        # Engine (vLLM, as events carry it) hash -> router hash of every prompt block prepared:
        # the router's indexes read a stored block's hash here instead of hashing it again.
        self.router_hash_of: dict[int | bytes, RouterHash] = {}

    def prepare(self, req: BenchRequest) -> PreparedPrompt:
        key = (req.phase, req.index)
        have = self._prepared.get(key)
        if have is not None and have.tokens is req.prompt_token_ids:
            return have
        out, known = self._prepare(tuple(req.prompt_token_ids), req.family)
        self._prepared[key] = out
        self.router_hash_of.update(zip(external_hashes(out.block_hashes[known:]), out.router_hashes[known:]))
        return out

    def _prepare(self, tokens: tuple[int, ...], family: str | None) -> tuple[PreparedPrompt, int]:
        """The prompt, and how many of its leading blocks an earlier prompt had (hashed then)."""
        bs = self.block_size
        fam = self._families.get(family) if family is not None else None
        if fam is None:
            out = PreparedPrompt(tokens, hash_blocks(tokens, bs), hittable_hashes(tokens, bs), _id_range(tokens))
            if family is not None:
                self._families[family] = _Family(out)
            return out, 0
        first = fam.first.tokens
        if fam.shared is None:
            fam.shared = _common_prefix(first, tokens)
            fam.shared_range = _id_range(first[:fam.shared])
        shared = fam.shared
        # Spot checks: a member that does not start like the family's first is a caller's bug.
        for lo in (0, max(0, shared - bs)):
            assert tokens[lo:lo + bs] == first[lo:lo + bs] or lo + bs > shared, (
                f"a request of family {family!r} differs from the family's first within the "
                f"{shared} tokens they should share: not a prefix family (bench/workloads.py)")
        known = shared // bs
        rest = _id_range(tokens[shared:])
        id_range = (min(fam.shared_range[0], rest[0]), max(fam.shared_range[1], rest[1])) if shared else rest
        return PreparedPrompt(tokens, hash_blocks(tokens, bs, fam.first.block_hashes[:known]),
                              hittable_hashes(tokens, bs, fam.first.router_hashes[:known]), id_range), known
