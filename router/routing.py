"""The router's choice of P and D for each request, and its prediction of their prefix hits.

`InstancePicker.pick` hashes the prompt once (router/prefix_index.py), asks the
prefix lookup (the KV-event feed, router/kv_events.py) how many leading blocks
each instance holds, and applies the configured policy (router/policies.py) to
what the router itself counts of each instance's load (router/instance_loads.py):

- P: prefill tokens it has been given and not finished (prompt minus the hit
  predicted when it was picked), their predicted prefill time (router/prefill_cost.py),
  and how many such requests;
- D: KV tokens of the requests it holds (prompt + max_tokens each, what D's
  blocks must cover), and how many.

Both counts are the router's own, updated as requests start and end, so they
are never stale the way a polled engine gauge is between two polls; they
count requests from this router only.

With `pending` (router/pending_blocks.py), what a P holds is what its events confirmed
plus the blocks of requests routed to it and not yet confirmed: a request of a prefix
still being prefilled is routed behind that prefill (P takes requests in order) and
hits. `pick` marks the chosen P's promise at once, `prefilling` marks it finished when
P is done, and `ended` withdraws it if P was not. D admits a request as it arrives,
before blocks still on their way are there: on D only confirmed blocks count.

The predicted hits (P's and D's) go into the request's timeline beside what the
engines then report, so a misprediction (an evicted block, a missed event) is
visible per request and in the metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pdcluster.proto.router_spec import LocalPrefillSpec, Policy
from pdcluster.router.instance_loads import InstanceLoad, LoadCounts
from pdcluster.router.local_prefill import LocalDecision, LocalView, decide
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.policies import DecodeView, PrefillView, pick_decode, pick_prefill
from pdcluster.router.prefill_cost import FittedCost, PrefillCost
from pdcluster.router.prefix_index import RouterHash, hittable_hashes


class PrefixLookup(Protocol):
    def matched_blocks(self, instance: str, hashes: Sequence[RouterHash]) -> int:
        """How many leading blocks of a prompt (its chain hashes) `instance` holds; 0 if unknown."""

    def tier_matched_blocks(self, instance: str, hashes: Sequence[RouterHash], start: int) -> int:
        """How many blocks past the first `start` `instance`'s host KV tier holds, in a run (it loads
        them instead of computing them); 0 if it has none."""

    def clears(self, instance: str) -> int:
        """How many times what `instance` holds was emptied (cache reset, restart): a promise of
        blocks made before the last one is void."""

    def holds(self, instance: str, block: RouterHash) -> bool:
        """Whether `instance` holds this block (wherever it sits in a prompt's chain)."""

    def removals(self, instance: str) -> int:
        """How many blocks `instance` evicted, as its events said, so far."""

    def removed_since(self, instance: str, block: RouterHash, removals: int) -> bool:
        """Whether `instance` evicted this block after its `removals` count was that."""

    def stale(self, instance: str) -> bool:
        """Whether `instance`'s index lost events: it may miss blocks the instance holds."""


class _Named(Protocol):
    name: str


I = TypeVar("I", bound=_Named)  # noqa: E741  (the instance type: pd_dispatch.Instance, or a test's)


@dataclass(frozen=True)
class Route(Generic[I]):
    prefill: I
    decode: I
    # Tokens of the prompt the router expects each side's prefix cache to hold; None: no lookup.
    predicted_p_hit_tokens: int | None
    predicted_d_hit_tokens: int | None
    # Of P's, the tokens only pending there (routed, not yet confirmed by KV events).
    predicted_p_pending_tokens: int | None = None
    key: int = -1  # this route's promises in the pending blocks (unique per picker)
    # P's time for it alone, as the cost model predicts: what it adds to P's queue.
    p_work_s: float = 0.0
    # P's first step of it to its last, shared with the work queued before and after it.
    predicted_p_prefill_s: float = 0.0
    # Whether D prefills it itself (router/local_prefill.py), and why; None: not decided (never).
    local: LocalDecision | None = None
    # Of each side's predicted hit, the tokens in its host KV tier (loaded, not computed).
    predicted_p_tier_tokens: int | None = None
    predicted_d_tier_tokens: int | None = None
    # Who prefills it (D for a local prefill, else P) reads the prompt's first `pool_tokens` from
    # this P's host tier first (the pool, docs/kv_tiers.md); None: no pool read.
    pool: I | None = None
    p_pool_tokens: int = 0  # P's pool read (the run's end); a local prefill's is `local.pool_tokens`

    @property
    def local_prefill(self) -> bool:
        return self.local is not None and self.local.local

    @property
    def pool_tokens(self) -> int:
        if self.pool is None:
            return 0
        return self.local.pool_tokens if self.local_prefill else self.p_pool_tokens


class NoInstanceUp(Exception):
    """Every instance of a role is down (dead, restarting, or unreachable); the message names them."""


class InstancePicker(LoadCounts[I], Generic[I]):
    """Picks P and D by policy among the instances `is_up` says are reachable now (all, if
    None): a dead or cut-off instance gets no new request until it is back."""

    def __init__(self, policy: Policy, prefill: Sequence[I], decode: Sequence[I], block_size: int,
                 lookup: PrefixLookup | None = None, is_up: Callable[[str], bool] | None = None,
                 pending: PendingBlocks | None = None, clock: Callable[[], float] = time.monotonic,
                 cost: PrefillCost | None = None, local: LocalPrefillSpec | None = None, p_pool: bool = False):
        """`pending`: the blocks of routed requests count as held from the moment they are
        routed (router/pending_blocks.py); None: only what the lookup says. `cost`: P's prefill
        time (router/prefill_cost.py); by default fitted from the prefills P reports. `local`:
        when D prefills a request itself (router/local_prefill.py); None: never. `p_pool`: a P
        may read the prompt's first blocks from a peer P's host tier (spec router.p_pool)."""
        assert policy != "prefix_aware" or lookup is not None, (
            "prefix_aware routing needs a prefix lookup (the KV-event feed)")
        assert pending is None or lookup is not None, "pending blocks extend a prefix lookup: give one"
        assert local is None or local.policy == "never" or lookup is not None, (
            "local prefill decides on D's prefix hit: it needs a prefix lookup (the KV-event feed)")
        self.policy = policy
        self.prefill, self.decode = list(prefill), list(decode)
        self.block_size = block_size
        self.lookup = lookup
        self.is_up = is_up
        self.pending = pending
        self._clock = clock
        self.cost = cost if cost is not None else FittedCost()
        self.local = local if local is not None and local.policy != "never" else None
        self.p_pool = p_pool and lookup is not None
        # No disaggregation: every request on D (there may be no P at all).
        self.colocated = self.local is not None and self.local.policy == "always"
        self._turn = itertools.count()
        self._keys = itertools.count()
        self._load = {i.name: InstanceLoad() for i in [*prefill, *decode]}  # (router/instance_loads.py)

    def replace(self, instance: I) -> None:
        """The instance of the same name, as it is now (e.g. restarted at another address)."""
        for role in (self.prefill, self.decode):
            for k, have in enumerate(role):
                if have.name == instance.name:
                    role[k] = instance
                    return
        raise KeyError(f"no instance {instance.name!r} to replace")

    def _up(self, role: str, instances: list[I], avoid: frozenset[str] = frozenset()) -> list[I]:
        up = [i for i in instances if i.name not in avoid and (self.is_up is None or self.is_up(i.name))]
        if not up:
            lost = [i.name for i in instances if i.name in avoid]
            raise NoInstanceUp(f"no {role} instance is up ({', '.join(i.name for i in instances)} all down"
                               + (f"; lost under this request: {', '.join(lost)})" if lost else ")"))
        return up

    def any_up(self, role: str, avoid: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether an instance of the role is up, leaving out `avoid`."""
        return any(i.name not in avoid and (self.is_up is None or self.is_up(i.name))
                   for i in (self.prefill if role == "prefill" else self.decode))

    def least_queued_s(self) -> float:
        """The predicted prefill time queued on the least-loaded live P (0 if none is up)."""
        return min((self._load[p.name].seconds for p in self.prefill if self.is_up is None or self.is_up(p.name)),
                   default=0.0)

    def pick(self, prompt_token_ids: Sequence[int], max_tokens: int, avoid: frozenset[str] = frozenset(),
             hashes: Sequence[RouterHash] | None = None, pool: bool = True) -> Route[I]:
        """Raises NoInstanceUp if a role has no instance up. `avoid`: instances lost under this
        request (router/migration.py), not picked even if their channel still looks up.
        `hashes`: the prompt's `hittable_hashes`, if the caller has them already (the virtual
        clock works them out once per prompt). `pool`: False, D reads no P's tier (a read failed)."""
        turn = next(self._turn)
        n = len(prompt_token_ids)
        if self.colocated:
            return self._pick_colocated(prompt_token_ids, avoid, hashes, turn)
        decode = self._up("decode", self.decode, avoid)
        if self.local is not None and not self.any_up("prefill", avoid):  # D alone serves, rather than a 503
            return self._pick_d_alone(prompt_token_ids, decode, hashes, turn)
        prefill = self._up("prefill", self.prefill, avoid)
        matched_p = matched_d = pending_p = tier_p = tier_d = None
        if self.lookup is None:
            hashes = []
        if self.lookup is not None:
            hashes = list(hashes) if hashes is not None else hittable_hashes(prompt_token_ids, self.block_size)
            matched_p, pending_p, tier_p = self._matched(prefill, hashes, self.pending)
            # D takes a request in as it arrives (in push mode, with P's), long before blocks another
            # request is still receiving are there: only what D's events confirmed is a hit on D.
            matched_d, _, tier_d = self._matched(decode, hashes, None)
        d_pool = self.local is not None and self.local.pool and pool
        runs = self._tier_runs(prefill, hashes) if self.p_pool or d_pool else {}
        p_views = self._prefill_views(prefill, matched_p, n, tier_p, runs if self.p_pool else None)
        d_views = self._decode_views(decode, matched_d)
        p_view = pick_prefill(self.policy, p_views, turn)
        p_name = p_view.name
        d_name = pick_decode(self.policy, d_views, turn).name
        p = next(i for i in prefill if i.name == p_name)
        d = next(i for i in decode if i.name == d_name)
        local = None
        if self.local is not None:
            d_holder, d_run = self._pool(prefill, runs, p_name) if d_pool else (None, 0)
            local = decide(self.local, LocalView(n, matched_d[d_name], self.lookup.stale(d_name),
                                                 self._load[d_name].local, self._load[p_name].seconds, d_run))
        if local is not None and local.local:  # D prefills: it may read a P's tier first
            holder, p_run = (d_holder if local.pool_tokens else None), 0
        else:  # P prefills: it may read a peer's tier first
            holder = next((i for i in prefill if i.name == p_view.pool_from), None)
            p_run = p_view.matched_tokens if holder is not None else 0
        taken_s = self.cost.taken_s(p_view.matched_tokens, n, p_view.queued_tokens, p_view.queued_s,
                                    p_view.tier_tokens, p_view.pool_read_tokens)
        route = Route(p, d, p_view.matched_tokens if matched_p else None, matched_d[d_name] if matched_d else None,
                      pending_p[p_name] if pending_p else None, next(self._keys), p_view.prefill_s, taken_s, local,
                      tier_p[p_name] if tier_p else None, tier_d[d_name] if tier_d else None, holder, p_run)
        if self.pending is not None and not route.local_prefill:  # at once: the next request of this prefix sees it on this P
            self.pending.add(p.name, route.key, hashes)
        return route

    def _pick_d_alone(self, prompt_token_ids: Sequence[int], decode: list[I], hashes: Sequence[RouterHash] | None,
                      turn: int) -> Route[I]:
        """No P is up: the D the policy picks prefills the request itself, whatever it lacks."""
        n = len(prompt_token_ids)
        hashes = list(hashes) if hashes is not None else hittable_hashes(prompt_token_ids, self.block_size)
        matched, _, tier = self._matched(decode, hashes, None)
        view = pick_decode(self.policy, self._decode_views(decode, matched), turn)
        d = next(i for i in decode if i.name == view.name)
        local = decide(self.local, LocalView(n, matched[d.name], self.lookup.stale(d.name), self._load[d.name].local,
                                             0.0, p_up=False))
        return Route(d, d, None, matched[d.name], None, next(self._keys), 0.0, 0.0, local, None, tier[d.name])

    def _pick_colocated(self, prompt_token_ids: Sequence[int], avoid: frozenset[str],
                        hashes: Sequence[RouterHash] | None, turn: int) -> Route[I]:
        """No disaggregation (router.local_prefill.policy always): D prefills and decodes every
        request, so D is picked as P would be (its hit, pending blocks included, and the predicted
        prefill queued on it) and is the route's P too."""
        n = len(prompt_token_ids)
        decode = self._up("decode", self.decode, avoid)
        matched = pending = tier = None
        if self.lookup is not None:
            hashes = list(hashes) if hashes is not None else hittable_hashes(prompt_token_ids, self.block_size)
            matched, pending, tier = self._matched(decode, hashes, self.pending)
        view = pick_prefill(self.policy, self._prefill_views(decode, matched, n, tier), turn)
        d = next(i for i in decode if i.name == view.name)
        local = decide(self.local, LocalView(n, view.matched_tokens, False, self._load[d.name].local, 0.0))
        route = Route(d, d, None, view.matched_tokens if matched else None, None, next(self._keys), view.prefill_s,
                      self.cost.taken_s(view.matched_tokens, n, view.queued_tokens, view.queued_s, view.tier_tokens),
                      local, None, view.tier_tokens if matched else None)
        if self.pending is not None:  # the next request of this prefix sees it on this D at once
            self.pending.add(d.name, route.key, hashes or [])
        return route

    def _decode_views(self, instances: list[I], matched: dict[str, int] | None) -> list[DecodeView]:
        """What pick_decode weighs of each D: the KV it holds for its requests, and its hit."""
        return [DecodeView(d.name, self._load[d.name].tokens, self._load[d.name].requests,
                           matched[d.name] if matched else 0) for d in instances]

    def _tier_runs(self, prefill: list[I], hashes: list[RouterHash]) -> dict[str, int]:
        """Per P whose index is not stale: the run of the prompt's first blocks its host tier
        holds, in tokens (what it offers a reader: the pool)."""
        return {p.name: self.lookup.tier_matched_blocks(p.name, hashes, 0) * self.block_size
                for p in prefill if not self.lookup.stale(p.name)}

    def _pool(self, prefill: list[I], runs: dict[str, int], picked: str) -> tuple[I | None, int]:
        """The P whose host tier holds the longest run (the picked P first among equals), and
        that run; (None, 0): none holds any."""
        best, run = None, 0
        for p in sorted(prefill, key=lambda i: i.name != picked):
            if runs.get(p.name, 0) > run:
                best, run = p, runs[p.name]
        return best, run

    def _prefill_views(self, instances: list[I], matched: dict[str, int] | None, n: int,
                       tier: dict[str, int] | None, runs: dict[str, int] | None = None) -> list[PrefillView]:
        """What pick_prefill weighs of each instance that would prefill a prompt of n tokens: what
        it holds of it (in its tier, of that), its queue, and the prompt's predicted time there.
        With `runs` (router.p_pool), what it holds may be a longer run in a peer's tier, read
        first where the cost says that is cheaper than computing it."""
        views = []
        for i in instances:
            held, tiered = (matched[i.name], tier[i.name]) if matched and tier else (0, 0)
            load = self._load[i.name]
            view = PrefillView(i.name, held, load.tokens, load.requests, load.seconds,
                               self.cost.seconds(held, n, tiered), tiered)
            if runs:
                peer, run = max(((p, r) for p, r in runs.items() if p != i.name and r > held),
                                key=lambda pr: pr[1], default=(None, 0))
                if peer is not None and (s := self.cost.seconds(run, n, tiered, run - held)) < view.prefill_s:
                    view = dataclasses.replace(view, matched_tokens=run, prefill_s=s, pool_from=peer,
                                               pool_read_tokens=run - held)
            views.append(view)
        return views

    def _matched(self, instances: list[I], hashes: list[RouterHash],
                 pending: PendingBlocks | None) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Per instance: the prompt tokens it holds or is promised, of those the promised, and
        of those the ones in its host tier."""
        held, promised, tiered = {}, {}, {}
        now = self._clock()
        for i in instances:
            confirmed = self.lookup.matched_blocks(i.name, hashes)
            extra = 0
            if pending is not None:
                pending.settle(i.name, now, self.lookup.clears(i.name), lambda h, name=i.name: self.lookup.holds(name, h),
                               lambda h, mark, name=i.name: self.lookup.removed_since(name, h, mark))
                extra = pending.pending_blocks(i.name, hashes, confirmed)
            # Then what its host tier holds past that: loaded, not computed (priced by the cost's tier term).
            tier = self.lookup.tier_matched_blocks(i.name, hashes, confirmed + extra)
            held[i.name], promised[i.name] = (confirmed + extra + tier) * self.block_size, extra * self.block_size
            tiered[i.name] = tier * self.block_size
        return held, promised, tiered
