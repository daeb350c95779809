"""A load's prompts, hashed once: what every instance and the router would each work out again.

A 131,076-token prompt costs ~4 ms of vLLM block hashes (the pools' keys, block_pool.py),
~3.5 ms of the router's (router/prefix_index.py) and ~3 ms for its id range; C90's 672
prompts, hashed by P, D and the router, would take ~10 s. Here each prompt is hashed once,
with the router's hash, whose chain the pools key their blocks by too: a prefix cache needs
only that equal blocks (same tokens, same history) have equal hashes and others not, which
both chains give; vLLM's own hash function matters on the wire to the router, which the
virtual clock does not have (the pools' events carry the router's hashes, which its indexes
take as they are). A prefix family's shared part is hashed once per family: requests of
one `family` (cluster/replay/workloads.py builds them as its prefix + their own suffix) start with
the same tokens, as long as the first two members do (checked exactly), and each later
member's first and last shared block are checked against them too. A prepared prompt is
kept by the request's place in the load, so a sweep over cluster configurations
(`pdc plan`) hashes the load once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdcluster.cluster.replay.records import BenchRequest
from pdcluster.router.prefix_index import RouterHash, extend_chain_bytes, token_bytes


@dataclass(frozen=True)
class PreparedPrompt:
    tokens: tuple[int, ...]
    block_hashes: list[RouterHash]  # every full block's (the pool's keys: SimRequest.block_hashes)
    router_hashes: list[RouterHash]  # of those, the hittable blocks' (InstancePicker.pick)
    id_range: tuple[int, int]


@dataclass
class _Family:
    first: PreparedPrompt
    shared: int | None = None  # tokens every member shares with the first; None: one member seen
    shared_range: tuple[int, int] = (0, 0)


def _id_range(ids: np.ndarray) -> tuple[int, int]:
    return (int(ids.min()), int(ids.max())) if ids.size else (0, 0)


def _prompt(tokens: tuple[int, ...], block_size: int, known: list[RouterHash] = (), shared: int = 0,
            shared_range: tuple[int, int] = (0, 0)) -> PreparedPrompt:
    """The prompt's hashes, extending `known` (its first blocks', hashed before), and its id
    range: `shared_range`, that of its first `shared` tokens (a family's), and the rest's."""
    start = len(known) * block_size
    assert start <= shared or not known, f"{len(known)} blocks known, only {shared} tokens shared"
    data = token_bytes(tokens[start:])  # once, for the hashes and the id range (~20x faster than min/max)
    rest = np.frombuffer(data, dtype="<u4")[shared - start if shared else 0:]
    if not shared:
        id_range = _id_range(rest)
    elif not rest.size:
        id_range = shared_range
    else:
        lo, hi = _id_range(rest)
        id_range = (min(shared_range[0], lo), max(shared_range[1], hi))
    hashes = extend_chain_bytes(known, data, block_size)
    return PreparedPrompt(tokens, hashes, hashes[:max(len(tokens) - 1, 0) // block_size], id_range)


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

    def prepare(self, req: BenchRequest) -> PreparedPrompt:
        key = (req.phase, req.index)
        have = self._prepared.get(key)
        if have is not None and have.tokens is req.prompt_token_ids:
            return have
        out = self._prepare(tuple(req.prompt_token_ids), req.family)
        self._prepared[key] = out
        return out

    def _prepare(self, tokens: tuple[int, ...], family: str | None) -> PreparedPrompt:
        bs = self.block_size
        fam = self._families.get(family) if family is not None else None
        if fam is None:
            out = _prompt(tokens, bs, [])
            if family is not None:
                self._families[family] = _Family(out)
            return out
        first = fam.first.tokens
        if fam.shared is None:
            fam.shared = _common_prefix(first, tokens)
            fam.shared_range = _id_range(np.frombuffer(token_bytes(first[:fam.shared]), dtype="<u4"))
        shared = fam.shared
        # Spot checks: a member that does not start like the family's first is a caller's bug.
        for lo in (0, max(0, shared - bs)):
            assert tokens[lo:lo + bs] == first[lo:lo + bs] or lo + bs > shared, (
                f"a request of family {family!r} differs from the family's first within the "
                f"{shared} tokens they should share: not a prefix family (cluster/replay/workloads.py)")
        known = shared // bs
        return _prompt(tokens, bs, fam.first.block_hashes[:known], shared, fam.shared_range)
