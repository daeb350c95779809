"""InstancePicker (router/routing.py): policies over predicted hits and the router's own load counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from pdcluster.router.prefix_index import chain_hashes
from pdcluster.router.routing import InstancePicker

BS = 4


@dataclass(frozen=True)
class Inst:
    name: str


class HeldBlocks:
    """A prefix lookup over hand-placed prompts: instance -> the chain hashes it holds."""

    def __init__(self):
        self.held: dict[str, set[bytes]] = {}
        self.tier: dict[str, set[bytes]] = {}  # what each instance's host tier holds
        self.emptied: dict[str, int] = {}
        self.stale_instances: set[str] = set()
        self.removed: dict[str, dict[bytes, int]] = {}  # instance -> block -> its removal's number

    def evict(self, instance: str, tokens: Sequence[int]) -> None:
        removed = self.removed.setdefault(instance, {})
        for h in chain_hashes(tokens, BS):
            self.held.get(instance, set()).discard(h)
            removed[h] = len(removed) + 1

    def store(self, instance: str, tokens: Sequence[int], where: str = "device") -> None:
        (self.held if where == "device" else self.tier).setdefault(instance, set()).update(chain_hashes(tokens, BS))

    def matched_blocks(self, instance: str, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.held.get(instance, set()):
                break
            n += 1
        return n

    def tier_matched_blocks(self, instance: str, hashes: Sequence[bytes], start: int) -> int:
        n = start
        while n < len(hashes) and hashes[n] in self.tier.get(instance, set()):
            n += 1
        return n - start

    def clears(self, instance: str) -> int:
        return self.emptied.get(instance, 0)

    def holds(self, instance: str, block: bytes) -> bool:
        return block in self.held.get(instance, set())

    def removals(self, instance: str) -> int:
        return len(self.removed.get(instance, {}))

    def removed_since(self, instance: str, block: bytes, removals: int) -> bool:
        return self.removed.get(instance, {}).get(block, -1) > removals

    def stale(self, instance: str) -> bool:
        return instance in self.stale_instances

    def reset(self, instance: str) -> None:
        self.held.pop(instance, None)
        self.emptied[instance] = self.emptied.get(instance, 0) + 1


def family(f: int, n: int = 16, suffix: int = 0) -> list[int]:
    """A prompt of family f: 12 tokens shared by the family, then its own."""
    return [100 * f + i for i in range(12)] + [1000 + suffix + i for i in range(n - 12)]


def picker(policy: str, lookup=None, n_p: int = 3, n_d: int = 2) -> InstancePicker:
    return InstancePicker(policy, [Inst(f"p{i}") for i in range(n_p)], [Inst(f"d{i}") for i in range(n_d)], BS,
                          lookup)


def test_prefix_aware_goes_where_the_prefix_is_and_predicts_the_hit():
    held = HeldBlocks()
    held.store("p2", family(1))
    held.store("d1", family(1))
    route = picker("prefix_aware", held).pick(family(1, suffix=50), max_tokens=8)
    assert (route.prefill.name, route.predicted_p_hit_tokens) == ("p2", 12)
    # D by load; all idle, the one holding the prefix.
    assert (route.decode.name, route.predicted_d_hit_tokens) == ("d1", 12)


def test_a_prefix_in_a_p_s_host_tier_is_a_hit_there_past_its_device_s():
    held = HeldBlocks()
    held.store("p0", family(1)[:4])  # one block on p0's device
    held.store("p1", family(1)[:4])
    held.store("p1", family(1), where="tier")  # p1's tier holds all three
    route = picker("prefix_aware", held).pick(family(1, suffix=50), max_tokens=8)
    assert (route.prefill.name, route.predicted_p_hit_tokens) == ("p1", 12)


def test_of_two_ps_holding_a_prefix_the_one_that_need_not_load_it_from_its_tier_wins():
    held = HeldBlocks()
    held.store("p0", family(1), where="tier")
    held.store("p2", family(1))
    pick = picker("prefix_aware", held)
    for cached in (8, 0):  # P loads a tier hit at 1 ms a token here
        pick.prefilled(cached, 16, 0.010 * (16 - cached) + 0.001 * cached, tier_tokens=cached)
    pick.prefilled(4, 16, 0.010 * 12)
    route = pick.pick(family(1, suffix=50), max_tokens=8)
    assert (route.prefill.name, route.predicted_p_hit_tokens) == ("p2", 12)
    assert pick.cost.seconds(12, 16, tier_tokens=12) - pick.cost.seconds(12, 16) == pytest.approx(0.012)


def test_prefix_aware_leaves_a_busy_holder_when_its_queue_costs_more():
    held = HeldBlocks()
    held.store("p0", family(1))
    pk = picker("prefix_aware", held, n_p=2)
    first = pk.pick(family(1, n=100), max_tokens=1)
    assert first.prefill.name == "p0"
    with pk.prefilling(first, 100):  # p0 now has 88 tokens to compute
        second = pk.pick(family(1, n=40), max_tokens=1)
    assert second.prefill.name == "p1" and second.predicted_p_hit_tokens == 0


def test_prefix_aware_spreads_families_over_idle_instances():
    held = HeldBlocks()
    pk = picker("prefix_aware", held)
    for f in range(3):
        route = pk.pick(family(f), 4)
        assert route.prefill.name == f"p{f}"
        held.store(route.prefill.name, family(f))  # as the KV events would report
    assert pk.pick(family(1, suffix=9), 4).prefill.name == "p1"


def test_round_robin_ignores_the_cache_but_still_predicts():
    held = HeldBlocks()
    held.store("p0", family(1))
    pk = picker("round_robin", held)
    routes = [pk.pick(family(1), 4) for _ in range(4)]
    assert [r.prefill.name for r in routes] == ["p0", "p1", "p2", "p0"]
    assert [r.predicted_p_hit_tokens for r in routes] == [12, 0, 0, 12]


def test_no_lookup_no_prediction():
    route = picker("least_load").pick(family(1), 4)
    assert route.predicted_p_hit_tokens is None and route.predicted_d_hit_tokens is None


def test_prefix_aware_needs_a_lookup():
    with pytest.raises(AssertionError, match="needs a prefix lookup"):
        picker("prefix_aware")


def test_least_load_spreads_and_counts_return_to_zero():
    pk = picker("least_load")
    a = pk.pick(family(1), max_tokens=10)
    with pk.prefilling(a, 16), pk.decoding(a, 16, 10):
        b = pk.pick(family(2), max_tokens=10)
        assert (a.prefill.name, b.prefill.name) == ("p0", "p1")
        assert (a.decode.name, b.decode.name) == ("d0", "d1")
        assert pk.queued_tokens()["p0"] == 16 and pk.queued_tokens()["d0"] == 26
        assert pk.in_flight()["p0"] == 1
    assert set(pk.queued_tokens().values()) == {0} and set(pk.in_flight().values()) == {0}


def test_a_request_of_n_choices_weighs_on_d_as_n_sequences():
    pk = picker("least_load")
    a, b = pk.pick(family(1), max_tokens=10), pk.pick(family(2), max_tokens=10)
    assert (a.decode.name, b.decode.name) == ("d0", "d1")
    with pk.decoding(a, 16, 10, n=3), pk.decoding(b, 20, 10):
        assert (pk.in_flight()["d0"], pk.queued_tokens()["d0"]) == (3, 16 + 3 * 10)
        assert pk.pick(family(3), max_tokens=10).decode.name == "d1"  # 30 tokens' KV to keep, not 46
    assert set(pk.in_flight().values()) == {0} and set(pk.queued_tokens().values()) == {0}


def test_counts_return_to_zero_when_the_request_fails():
    pk = picker("least_load")
    route = pk.pick(family(1), 4)
    with pytest.raises(RuntimeError):
        with pk.prefilling(route, 16):
            raise RuntimeError("P died")
    assert pk.in_flight()["p0"] == 0 and pk.queued_tokens()["p0"] == 0


# -- blocks in flight (router/pending_blocks.py)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pending_picker(held: HeldBlocks, n_p: int = 3, track: bool = True, clock: Clock | None = None) -> InstancePicker:
    from pdcluster.router.pending_blocks import PendingBlocks

    return InstancePicker("prefix_aware", [Inst(f"p{i}") for i in range(n_p)], [Inst("d0"), Inst("d1")], BS,
                          held, pending=PendingBlocks(grace_s=2.0) if track else None, clock=clock or Clock())


def burst(pk: InstancePicker, prompts: list[list[int]]):
    """Route each prompt in turn while the earlier ones are still prefilling (a burst)."""
    import contextlib

    routes = []
    with contextlib.ExitStack() as running:
        for prompt in prompts:
            routes.append(pk.pick(prompt, max_tokens=4))
            running.enter_context(pk.prefilling(routes[-1], len(prompt)))
    return routes


def test_a_burst_of_a_new_family_queues_behind_its_first_prefill_on_one_p():
    pk = pending_picker(HeldBlocks())
    shared = list(range(700, 796))  # 24 blocks of history, then 4 tokens of each request's own
    routes = burst(pk, [shared + [2000 + 4 * i + j for j in range(4)] for i in range(6)])
    assert {r.prefill.name for r in routes} == {"p0"}
    # Each later request is predicted to hit the history, all of it pending (no event yet).
    assert [(r.predicted_p_hit_tokens, r.predicted_p_pending_tokens) for r in routes] == [(0, 0)] + [(96, 96)] * 5
    pk.pending.check_integrity()


def test_without_tracking_a_burst_of_a_new_family_prefills_it_cold_everywhere():
    pk = pending_picker(HeldBlocks(), track=False)
    shared = list(range(700, 796))
    routes = burst(pk, [shared + [2000 + 4 * i + j for j in range(4)] for i in range(3)])
    assert [r.prefill.name for r in routes] == ["p0", "p1", "p2"]
    assert {r.predicted_p_hit_tokens for r in routes} == {0}


def test_a_hot_family_is_copied_to_a_second_p_once_the_holders_queue_exceeds_two_cold_prefills():
    # 100-token prompts whose first 96 are the family's: 4 tokens each to compute on the holder
    # (charged 8) plus its queue, against 200 cold elsewhere. The holder's queue is 100 (the first,
    # cold) + 4 per request behind it: it stays cheaper up to the 25th request.
    same = [7] * 96
    routes = burst(pending_picker(HeldBlocks()), [same + [1000 + 4 * i + j for j in range(4)] for i in range(27)])
    names = [r.prefill.name for r in routes]
    assert names[:25] == ["p0"] * 25 and names[25] == "p1" and routes[25].predicted_p_hit_tokens == 0
    assert names[26] == "p1"  # p1 now holds it too (pending) and its queue is the shorter


class AttentionOnlyCost:
    """A prefill's time is its attention pairs only: each new token over all tokens before it."""

    def seconds(self, cached_tokens: int, prompt_tokens: int, tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        new = prompt_tokens - cached_tokens
        return new * (cached_tokens + new / 2)

    def observe(self, cached_tokens: int, prompt_tokens: int, seconds: float, tier_tokens: int = 0,
                pool_tokens: int = 0) -> None:
        pass

    def taken_s(self, cached_tokens: int, prompt_tokens: int, queued_tokens: int, queued_s: float,
                tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        return 10 * queued_tokens + queued_s  # what the picker hands it, to check


def test_the_copy_rule_is_in_time_a_warm_remainder_over_long_history_costs_more_than_its_tokens():
    # As above, but timed: cold 100 x 50 = 5,000; warm 4 x 98 = 392 (8% of the cold time for 4% of
    # its tokens). The holder wins while 2 x 392 + 5,000 + 392 (k - 1) < 2 x 5,000: up to k = 11.
    same = [7] * 96
    pk = pending_picker(HeldBlocks())
    pk.cost = AttentionOnlyCost()
    routes = burst(pk, [same + [1000 + 4 * i + j for j in range(4)] for i in range(14)])
    names = [r.prefill.name for r in routes]
    assert names[:12] == ["p0"] * 12 and names[12] == "p1" and names[13] == "p1"
    assert [r.p_work_s for r in routes[:2]] == [5000, 392]  # alone: what each adds to p0's queue
    # The time P takes once it starts it, asked with the queue on the P picked: the first request's
    # 100 tokens (5,000) ahead of the second.
    assert [r.predicted_p_prefill_s for r in routes[:2]] == [0, 10 * 100 + 5000]


def test_the_picker_learns_p_s_prefill_times_from_what_p_reports():
    pk = picker("least_load", HeldBlocks())
    assert pk.cost.seconds(0, 1000) == pytest.approx(1000 * pk.cost.per_token_s)  # the prior: linear
    for n in (1000, 2000, 4000):
        pk.prefilled(0, n, 1e-3 * n + 1e-7 * n * n / 2)  # weights plus attention
    assert pk.cost.seconds(0, 8000) == pytest.approx(8.0 + 3.2)
    assert pk.cost.seconds(6000, 8000) == pytest.approx(2.0 + 1e-7 * 2000 * 7000)


def probe(pk: InstancePicker, prompt: list[int]):
    """The route a request would get, without leaving its own promise behind."""
    route = pk.pick(prompt, 4)
    pk.ended(route)
    return route


def test_a_failed_requests_promise_is_withdrawn_and_a_finished_one_expires_into_the_events():
    held, clock = HeldBlocks(), Clock()
    pk = pending_picker(held, clock=clock)
    failed = pk.pick(family(3, n=40), max_tokens=4)
    with pytest.raises(RuntimeError):
        with pk.prefilling(failed, 40):
            raise RuntimeError("P died")
    pk.ended(failed)
    assert probe(pk, family(3, n=40, suffix=1)).predicted_p_pending_tokens == 0  # nothing promised any more
    # A request that prefills well: its promise stands until grace_s after, then the events rule.
    ok = prefilled(pk, family(4, n=40))
    pk.ended(ok)  # D failed afterwards: P's finished part stands
    clock.now = 1.9
    assert probe(pk, family(4, n=40, suffix=2)).predicted_p_pending_tokens == 12
    clock.now = 4.0
    later = probe(pk, family(4, n=40, suffix=3))
    assert (later.predicted_p_hit_tokens, later.predicted_p_pending_tokens) == (0, 0)  # the events never came
    held.store(ok.prefill.name, family(4, n=40))
    confirmed = probe(pk, family(4, n=40, suffix=4))
    assert (confirmed.prefill.name, confirmed.predicted_p_hit_tokens, confirmed.predicted_p_pending_tokens) == (
        ok.prefill.name, 12, 0)
    pk.pending.check_integrity()
    assert pk.pending.counts(ok.prefill.name).requests == 0


def prefilled(pk: InstancePicker, prompt: list[int]):
    """A request routed and prefilled well: its promise finished, its events not in yet."""
    route = pk.pick(prompt, 4)
    with pk.prefilling(route, len(prompt)):
        pass
    return route


def test_a_finished_prefill_whose_blocks_p_evicted_before_the_next_lookup_is_no_longer_promised():
    held = HeldBlocks()
    pk = pending_picker(held)
    done = prefilled(pk, family(7, n=40))
    held.store(done.prefill.name, family(7, n=40))  # its events: stored...
    held.evict(done.prefill.name, family(7, n=40))  # ...and evicted, both before the next lookup
    again = probe(pk, family(7, n=40, suffix=1))
    assert (again.predicted_p_hit_tokens, again.predicted_p_pending_tokens) == (0, 0)
    assert pk.pending.counts(done.prefill.name).evicted == 1


def test_a_cache_reset_voids_the_promises_of_finished_requests_but_not_of_running_ones():
    held = HeldBlocks()
    pk = pending_picker(held)
    done = prefilled(pk, family(5, n=40))
    running = pk.pick(family(6, n=40), 4)
    held.reset(done.prefill.name)
    held.reset(running.prefill.name)
    assert probe(pk, family(5, n=40, suffix=1)).predicted_p_hit_tokens == 0
    assert probe(pk, family(6, n=40, suffix=1)).predicted_p_pending_tokens == 12  # still being prefilled


def local_picker(held: HeldBlocks, max_tokens: int = 8, n_d: int = 1) -> InstancePicker:
    from pdcluster.proto.router_spec import LocalPrefillSpec
    from pdcluster.router.pending_blocks import PendingBlocks

    return InstancePicker("prefix_aware", [Inst("p0"), Inst("p1")], [Inst(f"d{i}") for i in range(n_d)], BS, held,
                          pending=PendingBlocks(), clock=Clock(),
                          local=LocalPrefillSpec(policy="short_remainder", max_tokens=max_tokens))


def test_d_holding_the_prompt_prefills_a_short_remainder_itself_and_p_is_promised_nothing():
    held = HeldBlocks()
    prompt = family(1, n=24)  # 6 blocks of 4
    held.store("d0", prompt[:16])  # D holds 4 of them: 8 tokens left, the threshold
    pk = local_picker(held)
    route = pk.pick(prompt, 4)
    assert route.local_prefill and route.local.reason == "short_remainder" and route.local.remainder_tokens == 8
    assert route.predicted_d_hit_tokens == 16
    assert pk.pending.counts("p0").requests == pk.pending.counts("p1").requests == 0
    with pk.prefilling_locally(route):
        # One local prefill at a time on D: the next goes through P, and P is promised its blocks.
        second = pk.pick(prompt, 4)
        assert not second.local_prefill and second.local.reason == "d_busy"
        assert pk.pending.counts(second.prefill.name).requests == 1
    assert pk.pick(prompt, 4).local_prefill  # the slot is free again
    pk.pending.check_integrity()


def test_over_the_threshold_or_on_a_stale_index_the_prefill_goes_to_p():
    held = HeldBlocks()
    prompt = family(1, n=24)
    held.store("d0", prompt[:12])  # 12 tokens left: over 8
    assert local_picker(held).pick(prompt, 4).local.reason == "long_remainder"
    held.store("d0", prompt)
    held.stale_instances.add("d0")
    route = local_picker(held).pick(prompt, 4)
    assert not route.local_prefill and route.local.reason == "stale_index"


def test_local_prefill_never_is_todays_routing():
    from pdcluster.proto.router_spec import LocalPrefillSpec

    held = HeldBlocks()
    prompt = family(1, n=24)
    held.store("d0", prompt)
    pk = InstancePicker("prefix_aware", [Inst("p0")], [Inst("d0")], BS, held, local=LocalPrefillSpec())
    route = pk.pick(prompt, 4)
    assert route.local is None and not route.local_prefill
