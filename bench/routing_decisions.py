"""Routing decisions per second: 16 instances, 128K-token prompts, hashing included (issue 6).

The router's real pieces, nothing re-implemented: `router.prefix_index`
(`chain_hashes`, `InstanceIndex`) and `router.policies` (`pick_prefill`,
`pick_decode`). Setup fills 8 P and 8 D indexes through `InstanceIndex.apply`
with BlockStored events shaped as a vLLM engine sends them: C90's 16 prefix
families (118,784 cached tokens, 928 blocks of 128 each) spread over the P
instances (family f on P f % 8, and on D f % 8 after its transfer), one event
per chunked-prefill step of 64 blocks, each event's parent the previous block's
engine hash; engine hashes are 64-bit ints salted per instance, as different
engines' hash seeds make them.

Each timed decision is what the router does for one request: hash a fresh
131,076-token prompt (a family's prefix + a new suffix), match the hashes on
all 16 indexes, build the instance views, pick P and D. Loads move between
decisions (the chosen P queues the uncached tokens, every queue drains a fixed
amount) so least_load and prefix_aware choose among unequal instances.

Then the same decision as the router makes it (`run_picker`): `InstancePicker.pick`
(router/routing.py) over a `KvEventFeed` (router/kv_events.py) whose indexes got
the same events, locks and all, timed as one piece.

usage: python -m pdcluster.bench.routing_decisions [--decisions 200] [--policies round_robin,least_load,prefix_aware]
       [--no-picker]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdcluster.cluster.replay.presets import PRESETS
from pdcluster.proto.kv_event_wire import BlockStored
from pdcluster.proto.router_spec import Policy
from pdcluster.router.policies import DecodeView, PrefillView, pick_decode, pick_prefill
from pdcluster.router.prefill_cost import FittedCost
from pdcluster.router.prefix_index import InstanceIndex, RouterHash, chain_hashes, hittable_hashes

C90 = PRESETS["c90"]
BLOCK_SIZE = 128
VOCAB = 129_280  # DeepSeek-V4's vocabulary: token ids as large as the router sees
POLICIES: tuple[Policy, ...] = ("round_robin", "least_load", "prefix_aware")


def engine_hash(salt: int, router_hash: RouterHash) -> int:
    """A 64-bit engine block hash: vLLM's are per engine (its hash seed), so they differ by instance."""
    return int.from_bytes(hashlib.blake2b(router_hash, digest_size=8, key=salt.to_bytes(8, "little")).digest(),
                          "little")


def stored_events(tokens: Sequence[int], block_size: int, blocks_per_event: int, salt: int) -> list[BlockStored]:
    """The BlockStored events an engine emits while prefilling `tokens` into an empty cache:
    one per scheduler step of `blocks_per_event` full blocks, chained by parent hash."""
    hashes = [engine_hash(salt, h) for h in chain_hashes(tokens, block_size)]
    events, parent = [], None
    for first in range(0, len(hashes), blocks_per_event):
        part = hashes[first:first + blocks_per_event]
        events.append(BlockStored(block_hashes=tuple(part), parent_block_hash=parent,
                                  token_ids=tuple(tokens[first * block_size:(first + len(part)) * block_size]),
                                  block_size=block_size))
        parent = part[-1]
    return events


@dataclass
class Fleet:
    """16 instances' prefix indexes and loads, as the router holds them."""

    prefill: dict[str, InstanceIndex]
    decode: dict[str, InstanceIndex]
    family_prefixes: list[list[int]]
    owner: list[str]  # family -> the P holding its prefix
    block_size: int
    queued_tokens: dict[str, int] = field(default_factory=dict)  # P -> prefill tokens queued
    kv_tokens: dict[str, int] = field(default_factory=dict)  # D -> KV tokens its requests hold
    running: dict[str, int] = field(default_factory=dict)  # D -> requests decoding
    # The router's default for real engines: fitted from P's reports; here none, so its linear prior.
    cost: FittedCost = field(default_factory=FittedCost)


def build_fleet(n_prefill: int = 8, n_decode: int = 8, families: int = C90.num_prefixes,
                prefix_tokens: int = C90.shared_prefix_tokens, block_size: int = BLOCK_SIZE,
                blocks_per_event: int = 64, seed: int = 0,
                indexes: Mapping[str, InstanceIndex] | None = None) -> Fleet:
    """`indexes`: fill these (e.g. a KvEventFeed's, by instance name) instead of new ones."""
    assert prefix_tokens % block_size == 0, f"prefix of {prefix_tokens} tokens is not block-aligned ({block_size})"
    rng = random.Random(seed)
    index = (lambda name: indexes[name]) if indexes is not None else (lambda name: InstanceIndex(block_size))
    prefill = {f"prefill-{i}": index(f"prefill-{i}") for i in range(n_prefill)}
    decode = {f"decode-{i}": index(f"decode-{i}") for i in range(n_decode)}
    seq = {name: 0 for name in [*prefill, *decode]}
    prefixes, owner = [], []
    for f in range(families):
        prefix = [rng.randrange(VOCAB) for _ in range(prefix_tokens)]
        prefixes.append(prefix)
        holders = [(f"prefill-{f % n_prefill}", prefill), (f"decode-{f % n_decode}", decode)]
        owner.append(holders[0][0])
        for name, role in holders:
            salt = int(name.rsplit("-", 1)[1]) + (1000 if role is decode else 0)
            for ev in stored_events(prefix, block_size, blocks_per_event, salt):
                assert role[name].apply(seq[name], [ev]), f"{name}: batch {seq[name]} out of order (bench bug)"
                seq[name] += 1
    return Fleet(prefill, decode, prefixes, owner, block_size, queued_tokens=dict.fromkeys(prefill, 0),
                 kv_tokens=dict.fromkeys(decode, 0), running=dict.fromkeys(decode, 0))


def fresh_prompt(fleet: Fleet, family: int, input_len: int, rng: random.Random) -> list[int]:
    """A family's cached prefix, then a suffix no instance holds."""
    prefix = fleet.family_prefixes[family]
    return prefix + [rng.randrange(VOCAB) for _ in range(input_len - len(prefix))]


@dataclass(frozen=True)
class Decision:
    prefill: str
    decode: str
    matched_tokens: int  # on the chosen P
    hash_s: float
    match_s: float
    pick_s: float

    @property
    def total_s(self) -> float:
        return self.hash_s + self.match_s + self.pick_s


def decide(fleet: Fleet, policy: Policy, prompt: Sequence[int], turn: int) -> Decision:
    """One routing decision, timed in its three parts; then the fleet's loads move."""
    t0 = time.perf_counter()
    # As the router's picker: vLLM always computes the last prompt token, so its block can never hit.
    hashes = hittable_hashes(prompt, fleet.block_size)
    t1 = time.perf_counter()
    matched = {name: idx.matched_blocks(hashes) * fleet.block_size
               for name, idx in (*fleet.prefill.items(), *fleet.decode.items())}
    t2 = time.perf_counter()
    p = pick_prefill(policy, [PrefillView(name=name, matched_tokens=matched[name],
                                          queued_tokens=fleet.queued_tokens[name],
                                          queued_s=fleet.cost.seconds(0, fleet.queued_tokens[name]),
                                          prefill_s=fleet.cost.seconds(matched[name], len(prompt)))
                              for name in fleet.prefill], turn)
    d = pick_decode(policy, [DecodeView(name=name, kv_tokens=fleet.kv_tokens[name], running=fleet.running[name],
                                        matched_tokens=matched[name]) for name in fleet.decode], turn)
    t3 = time.perf_counter()
    _advance_loads(fleet, p.name, d.name, len(prompt), p.matched_tokens)
    return Decision(p.name, d.name, p.matched_tokens, t1 - t0, t2 - t1, t3 - t2)


def _advance_loads(fleet: Fleet, p: str, d: str, prompt_tokens: int, matched_tokens: int,
                   drain_tokens: int = 4096, max_running: int = 12) -> None:
    """P queues what it must compute, every P drains a fixed amount; D holds the prompt's KV
    until it has `max_running` requests, then one finishes for each new one."""
    fleet.queued_tokens[p] += prompt_tokens - matched_tokens
    for name in fleet.queued_tokens:
        fleet.queued_tokens[name] = max(0, fleet.queued_tokens[name] - drain_tokens)
    fleet.running[d] += 1
    fleet.kv_tokens[d] += prompt_tokens
    if fleet.running[d] > max_running:
        fleet.running[d] -= 1
        fleet.kv_tokens[d] -= prompt_tokens


@dataclass(frozen=True)
class PolicyResult:
    policy: str  # the policy, and how it was run if not piece by piece
    decisions: int
    decisions_per_s: float  # 1 / mean decision time
    total_ms: float  # median decision time
    hash_ms: float  # medians
    match_ms: float
    pick_ms: float
    owner_hits: float  # share of decisions that sent a family to the P holding its prefix


def summarize(policy: Policy, decisions: Sequence[Decision], owners: Sequence[str]) -> PolicyResult:
    assert decisions and len(decisions) == len(owners), "one owner per decision"
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return PolicyResult(
        policy, len(decisions), len(decisions) / sum(d.total_s for d in decisions), med([d.total_s for d in decisions]),
        med([d.hash_s for d in decisions]), med([d.match_s for d in decisions]), med([d.pick_s for d in decisions]),
        sum(d.prefill == o for d, o in zip(decisions, owners)) / len(decisions))


def run_policies(policies: Sequence[Policy], n: int, input_len: int, seed: int, warmup: int = 20,
                 fleet_seed: int = 0) -> list[PolicyResult]:
    """The same prompts through every policy, interleaved (one decision each in turn), each
    policy on its own copy of the fleet: drift on a shared machine hits all of them alike."""
    fleets = [build_fleet(seed=fleet_seed) for _ in policies]
    rng = random.Random(seed)
    families = len(fleets[0].family_prefixes)
    # Families in random order (in turn they would line up with round_robin's turns).
    order = [rng.randrange(families) for _ in range(warmup + n)]
    decisions: list[list[Decision]] = [[] for _ in policies]
    for turn, family in enumerate(order):
        # Built before the clock starts: tokenizing is the HTTP front end's cost, not routing's.
        prompt = fresh_prompt(fleets[0], family, input_len, rng)
        for i, (policy, fleet) in enumerate(zip(policies, fleets)):
            dec = decide(fleet, policy, prompt, turn)
            if turn >= warmup:
                decisions[i].append(dec)
    owners = [fleets[0].owner[f] for f in order[warmup:]]
    return [summarize(policy, decs, owners) for policy, decs in zip(policies, decisions)]


@dataclass(frozen=True)
class _Named:
    name: str


def run_picker(policies: Sequence[Policy], n: int, input_len: int, seed: int, warmup: int = 20,
               fleet_seed: int = 0, in_flight: int = 12, max_tokens: int = C90.output_len,
               n_prefill: int = 8, n_decode: int = 8, **fleet_args) -> list[PolicyResult]:
    """The router's own decision as wired: `InstancePicker.pick` (router/routing.py) over a
    `KvEventFeed` (router/kv_events.py) whose indexes hold the same events (applied directly:
    no sockets, the feed's thread not started). Loads are the picker's own counts: the last
    `in_flight` requests stay open on the P and D they were sent to. Timed as one piece."""
    from pdcluster.router.kv_events import KvEventFeed
    from pdcluster.router.routing import InstancePicker

    names = [f"prefill-{i}" for i in range(n_prefill)] + [f"decode-{i}" for i in range(n_decode)]
    block_size = fleet_args.get("block_size", BLOCK_SIZE)
    results = []
    for policy in policies:
        feed = KvEventFeed({name: ("tcp://127.0.0.1:1", None) for name in names}, block_size, curve=None)
        fleet = build_fleet(n_prefill, n_decode, seed=fleet_seed, indexes={name: feed.index(name) for name in names},
                            **fleet_args)
        picker = InstancePicker(policy, [_Named(x) for x in fleet.prefill], [_Named(x) for x in fleet.decode],
                                block_size, lookup=feed)
        rng = random.Random(seed)
        order = [rng.randrange(len(fleet.family_prefixes)) for _ in range(warmup + n)]
        open_requests: deque[contextlib.ExitStack] = deque()
        decisions, owners = [], []
        for turn, family in enumerate(order):
            prompt = fresh_prompt(fleet, family, input_len, rng)
            t0 = time.perf_counter()
            route = picker.pick(prompt, max_tokens)
            elapsed = time.perf_counter() - t0
            stack = contextlib.ExitStack()
            stack.enter_context(picker.prefilling(route, len(prompt)))
            stack.enter_context(picker.decoding(route, len(prompt), max_tokens))
            open_requests.append(stack)
            if len(open_requests) > in_flight:
                open_requests.popleft().close()
            if turn >= warmup:
                decisions.append(Decision(route.prefill.name, route.decode.name, route.predicted_p_hit_tokens or 0,
                                          0.0, 0.0, elapsed))
                owners.append(fleet.owner[family])
        while open_requests:
            open_requests.popleft().close()
        r = summarize(policy, decisions, owners)
        results.append(PolicyResult(f"{policy} (InstancePicker + KvEventFeed)", r.decisions, r.decisions_per_s,
                                    r.total_ms, float("nan"), float("nan"), float("nan"), r.owner_hits))
    return results


def format_table(results: Sequence[PolicyResult]) -> str:
    rows = ["| policy | decisions/s | ms per decision | hash ms | match ms (16 indexes) | pick ms | to the family's P |",
            "|---|---|---|---|---|---|---|"]
    ms = lambda x, digits: "-" if math.isnan(x) else f"{x:.{digits}f}"  # noqa: E731
    for r in results:
        rows.append(f"| {r.policy} | {r.decisions_per_s:,.1f} | {r.total_ms:.2f} | {ms(r.hash_ms, 2)} | "
                    f"{ms(r.match_ms, 3)} | {ms(r.pick_ms, 3)} | {r.owner_hits:.0%} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=200, help="timed decisions per policy")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--input-len", type=int, default=C90.input_len)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-picker", action="store_true", help="skip the InstancePicker + KvEventFeed rows")
    a = ap.parse_args()

    t0 = time.perf_counter()
    fleet = build_fleet(seed=a.seed)
    held = {name: len(idx) for name, idx in (*fleet.prefill.items(), *fleet.decode.items())}
    print(f"setup: 8 P + 8 D indexes from BlockStored events in {time.perf_counter() - t0:.1f} s; "
          f"blocks held per instance: {sorted(set(held.values()))}")
    results = run_policies(a.policies.split(","), a.decisions, a.input_len, a.seed + 1, fleet_seed=a.seed)
    if not a.no_picker:
        results += run_picker(a.policies.split(","), a.decisions, a.input_len, a.seed + 1, fleet_seed=a.seed)
    print(f"{a.decisions} decisions per policy (the same prompts, policies interleaved), {a.input_len:,}-token "
          f"prompts, block {BLOCK_SIZE}; ms are medians per decision; decisions/s = 1 / mean decision time "
          f"(one core, one thread)")
    print(format_table(results))


if __name__ == "__main__":
    main()
