"""The routing check shared by the sim and the real-vLLM e2e modules: prompts from a few
prefix families, sent one at a time under a policy, read back from the run's timelines."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass

from e2e import complete

from pdcluster.router.run_store import load_run
from pdcluster.router.timeline import RequestRecord


@dataclass(frozen=True)
class Families:
    """`count` prefixes of `prefix_tokens` each (block-aligned), distinct from their first token."""

    count: int
    prefix_tokens: int
    suffix_tokens: int
    vocab: int = 1000

    def prefix(self, f: int) -> list[int]:
        rng = random.Random(f"family-{f}")
        return [rng.randrange(1, self.vocab) for _ in range(self.prefix_tokens)]

    def prompt(self, f: int, n: int) -> list[int]:
        rng = random.Random(f"suffix-{f}-{n}")
        return self.prefix(f) + [rng.randrange(1, self.vocab) for _ in range(self.suffix_tokens)]


def shuffled_order(families: int, rounds: int, seed: int = 0) -> list[int]:
    """Every family `rounds` times; the first round in order, then shuffled, so round_robin
    cannot line families up with instances by accident."""
    rng = random.Random(seed)
    order = list(range(families))
    for _ in range(rounds - 1):
        batch = list(range(families))
        rng.shuffle(batch)
        order += batch
    return order


def under_policy(cluster, policy: str, fams: Families, order: list[int], tag: str) -> list[RequestRecord]:
    """From empty caches, the prompts in turn with the router on `policy`."""
    from e2e import reset_caches

    reset_caches(cluster)
    cluster.each_router("set_policy", policy)
    try:
        return send_in_turn(cluster, fams, order, tag)
    finally:
        cluster.each_router("set_policy", cluster.spec.router.policy)


def send_in_turn(cluster, fams: Families, order: list[int], tag: str, max_tokens: int = 4) -> list[RequestRecord]:
    """Each prompt after the last finished and the router's index has its events; the records, in order."""

    ids = []
    for n, f in enumerate(order):
        rid = f"{tag}-{n}-f{f}"
        r = complete(cluster.url, fams.prompt(f, n), max_tokens, request_id=rid)
        assert r.status_code == 200, r.text
        cluster.each_router("catch_up_kv_events")
        ids.append(r.json()["id"])
    return records_of(cluster, ids)


def records_of(cluster, ids: list[str], timeout: float = 10) -> list[RequestRecord]:
    """The run's records of these responses (`id` of each), waiting for the last to be written."""
    deadline = time.monotonic() + timeout
    while True:
        by_id = {r.request_id: r for r in load_run(cluster.run_dir).records}
        if all(i in by_id for i in ids) or time.monotonic() > deadline:
            missing = [i for i in ids if i not in by_id]
            assert not missing, f"no timeline record for {missing}"
            return [by_id[i] for i in ids]
        time.sleep(0.1)


def prefill_instances_per_family(records: list[RequestRecord], order: list[int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for f, rec in zip(order, records):
        out[f].append(rec.prefill_instance)
    return dict(out)


def structural_max_hit(fams: Families, order: list[int], block_size: int) -> int:
    """P's hit tokens if every request after a family's first found the family's whole prefix."""
    seen, total = set(), 0
    for f in order:
        if f in seen:
            total += fams.prefix_tokens // block_size * block_size
        seen.add(f)
    return total
