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

    def store(self, instance: str, tokens: Sequence[int]) -> None:
        self.held.setdefault(instance, set()).update(chain_hashes(tokens, BS))

    def matched_blocks(self, instance: str, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.held.get(instance, set()):
                break
            n += 1
        return n


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


def test_counts_return_to_zero_when_the_request_fails():
    pk = picker("least_load")
    route = pk.pick(family(1), 4)
    with pytest.raises(RuntimeError):
        with pk.prefilling(route, 16):
            raise RuntimeError("P died")
    assert pk.in_flight()["p0"] == 0 and pk.queued_tokens()["p0"] == 0
