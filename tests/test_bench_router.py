"""Unit tests of the router benchmarks' pure helpers (bench/routing_decisions.py, bench/router_overhead.py)."""

from __future__ import annotations

import random

from pdcluster.bench import routing_decisions as rd
from pdcluster.router.prefix_index import InstanceIndex, chain_hashes

BS = 4  # tokens per block in these tests


def small_fleet(families: int = 4, prefix_blocks: int = 5, blocks_per_event: int = 2) -> rd.Fleet:
    return rd.build_fleet(n_prefill=2, n_decode=3, families=families, prefix_tokens=prefix_blocks * BS,
                          block_size=BS, blocks_per_event=blocks_per_event, seed=7)


def test_stored_events_chain_blocks_in_steps_by_parent_hash():
    tokens = list(range(100, 100 + 5 * BS + 2))  # 5 full blocks and a partial one
    events = rd.stored_events(tokens, BS, blocks_per_event=2, salt=3)
    assert [len(e.block_hashes) for e in events] == [2, 2, 1]
    assert events[0].parent_block_hash is None
    assert [e.parent_block_hash for e in events[1:]] == [events[0].block_hashes[-1], events[1].block_hashes[-1]]
    assert [e.token_ids for e in events] == [tuple(tokens[0:8]), tuple(tokens[8:16]), tuple(tokens[16:20])]
    index = InstanceIndex(BS)
    for seq, ev in enumerate(events):
        assert index.apply(seq, [ev])
    assert index.matched_blocks(chain_hashes(tokens, BS)) == 5


def test_engine_hashes_differ_by_instance_salt():
    h = chain_hashes(list(range(BS)), BS)[0]
    assert rd.engine_hash(0, h) != rd.engine_hash(1, h)
    assert rd.engine_hash(1, h) == rd.engine_hash(1, h)


def test_fleet_holds_each_family_on_its_p_and_d_only():
    fleet = small_fleet()
    for f, prefix in enumerate(fleet.family_prefixes):
        hashes = chain_hashes(prefix, BS)
        held_p = {name: idx.matched_blocks(hashes) for name, idx in fleet.prefill.items()}
        held_d = {name: idx.matched_blocks(hashes) for name, idx in fleet.decode.items()}
        assert held_p == {name: 5 if name == f"prefill-{f % 2}" else 0 for name in fleet.prefill}
        assert held_d == {name: 5 if name == f"decode-{f % 3}" else 0 for name in fleet.decode}
        assert fleet.owner[f] == f"prefill-{f % 2}"


def test_prefix_aware_sends_a_family_to_its_p_and_predicts_the_prefix():
    fleet = small_fleet()
    prompt = rd.fresh_prompt(fleet, 3, 5 * BS + 7, random.Random(1))
    dec = rd.decide(fleet, "prefix_aware", prompt, turn=0)
    assert (dec.prefill, dec.matched_tokens) == ("prefill-1", 5 * BS)
    assert dec.hash_s >= 0 and dec.match_s >= 0 and dec.pick_s >= 0
    assert fleet.queued_tokens["prefill-1"] == 0  # 7 uncached tokens, drained at once
    assert fleet.running[dec.decode] == 1


def test_round_robin_goes_in_turn_whatever_is_cached():
    fleet = small_fleet()
    prompt = rd.fresh_prompt(fleet, 0, 5 * BS + 1, random.Random(1))  # family 0 lives on prefill-0
    assert [rd.decide(fleet, "round_robin", prompt, turn).prefill for turn in (0, 1, 2)] == [
        "prefill-0", "prefill-1", "prefill-0"]


def test_a_prompt_ending_on_a_block_boundary_cannot_hit_its_last_block():
    fleet = small_fleet()
    prompt = list(fleet.family_prefixes[0])  # exactly the 5 cached blocks
    assert rd.decide(fleet, "prefix_aware", prompt, turn=0).matched_tokens == 4 * BS


def test_run_policies_reports_each_policy_over_the_same_prompts():
    results = {r.policy: r for r in rd.run_policies(["round_robin", "prefix_aware"], n=12, input_len=7 * BS,
                                                    seed=2, warmup=1, fleet_seed=0)}
    assert set(results) == {"round_robin", "prefix_aware"}
    assert all(r.decisions == 12 and r.decisions_per_s > 0 for r in results.values())
    assert results["prefix_aware"].owner_hits == 1.0


def test_summarize_counts_decisions_sent_to_the_owner():
    decs = [rd.Decision("prefill-0", "decode-0", 0, 0.001, 0.001, 0.002),
            rd.Decision("prefill-1", "decode-0", 0, 0.001, 0.001, 0.002)]
    r = rd.summarize("least_load", decs, ["prefill-0", "prefill-0"])
    assert r.owner_hits == 0.5
    assert round(r.decisions_per_s) == 250
    assert "| least_load | 250.0 |" in rd.format_table([r])
