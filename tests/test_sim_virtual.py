"""The simulated cluster on the virtual clock (cluster/sim/virtual/), without Ray or engines:
the event order, exact TTFTs of hand-made cases, repeated decode steps changing nothing, and
a short C90-shaped load on P8+D8 with every hit the workload expects."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdcluster.cluster.replay.records import BenchRequest
from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.virtual.events import EXTERNAL, ORIGIN_NS, STEP, EventLoop
from pdcluster.cluster.sim.virtual.prompts import PromptCache
from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
from pdcluster.proto.spec import load_spec, parse_spec
from pdcluster.router.prefix_index import chain_hashes, hittable_hashes
from pdcluster.router.run_store import load_run

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PARAMS = Path(__file__).resolve().parents[1] / "cluster" / "sim" / "params"
MS = 1_000_000  # ns


def at(rec, *events: str) -> list[int]:
    """The record's events, in ns from the start of virtual time."""
    return [rec.events[e] - ORIGIN_NS for e in events]


def test_ties_run_external_events_first_then_steps_in_instance_order():
    loop, seen = EventLoop(0), []
    loop.at(5, lambda: seen.append("step d1"), STEP, 3)
    loop.at(5, lambda: seen.append("step p0"), STEP, 0)
    loop.at(5, lambda: seen.append("arrival a"), EXTERNAL)
    loop.at(5, lambda: seen.append("arrival b"), EXTERNAL)
    loop.at(2, lambda: loop.at(5, lambda: seen.append("load end"), EXTERNAL))
    loop.run()
    assert seen == ["arrival a", "arrival b", "load end", "step p0", "step d1"] and loop.now_ns == 5


def fixed_step_params(tmp_path: Path, prefill_s: float, decode_s: float, latency_s: float) -> Path:
    """A parameter file whose steps take exactly their overheads: the device is so fast, and
    hides so much behind the overhead, that nothing else is left of a step (to the ns)."""
    p = yaml.safe_load((PARAMS / "qwen3-0.6b-1dev.yaml").read_text())
    p["name"] = "fixed-steps"
    p["device"].update(gemm_flops=1e30, attention_flops=1e30, hbm_bytes_per_s=1e30)
    p["overheads"] = {"prefill_step_s": prefill_s, "decode_step_s": decode_s, "hidden_device_s": 1000.0}
    p["link"] = {"bytes_per_s": 1e20, "latency_s": latency_s}
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(p))
    return path


def p1d1(params: Path, mode: str = "push", **engine) -> object:
    return parse_spec({
        "name": "virtual-p1d1", "model": {"path": "/nonexistent"},
        "engine": {"kind": "sim", "block_size": 16, "max_model_len": 4096, "max_num_batched_tokens": 4096,
                   "max_num_seqs": 8, **engine},
        "sim": {"params": str(params), "kv_blocks": 256},
        "transfer": {"mode": mode}, "router": {"policy": "round_robin"}})


def hand_made(arrivals_s: list[float], prompt_len: int = 256, output_len: int = 3) -> list[BenchRequest]:
    return [BenchRequest(index=i, prompt_token_ids=tuple(100 * i + 3 + (k % 90) for k in range(prompt_len)),
                         output_len=output_len, arrival_s=t) for i, t in enumerate(arrivals_s)]


def timed(requests: list[BenchRequest], concurrency: int = 8) -> BenchConfig:
    """A load sent at the requests' own arrival times (the trace path of the driver)."""
    return BenchConfig(trace="hand-made", max_concurrency=concurrency, engine_block_size=16, progress=False)


def test_two_requests_with_known_step_times_give_exact_ttfts(tmp_path):
    # P steps 100 ms, D steps 10 ms, the link 5 ms. A at 0: P prefills it 0-100, its KV is at D at 105,
    # D's first step (the last prompt token) 105-115: TTFT 115 ms, then tokens at 125 and 135. B at 50:
    # D admits it at once (its load starts), P prefills it 100-200 behind A, KV at 205, first token 215:
    # TTFT 165 ms.
    spec = p1d1(fixed_step_params(tmp_path, 0.1, 0.01, 0.005))
    reqs = hand_made([0.0, 0.05])
    run = simulate(spec, timed(reqs), reqs, vocab_size=1000)
    a, b = sorted(run.records, key=lambda r: r.events["arrival"])
    assert at(a, "p_scheduled", "p_done", "transfer_start", "transfer_end", "d_scheduled", "first_token") == [
        0, 100 * MS, 0, 105 * MS, 105 * MS, 115 * MS]
    assert [t - ORIGIN_NS for t in a.token_ns] == [115 * MS, 125 * MS, 135 * MS]
    assert at(b, "arrival", "d_queued", "transfer_start", "p_scheduled", "p_done", "transfer_end",
              "first_token") == [
        50 * MS, 50 * MS, 50 * MS, 100 * MS, 200 * MS, 205 * MS, 215 * MS]
    formal = run.summaries["formal"].stats
    assert formal["TTFT"].avg == pytest.approx((0.115 + 0.165) / 2, abs=1e-12)
    assert formal["TPOT"].avg == pytest.approx(0.010, abs=1e-12)


def test_pull_mode_sends_d_the_request_when_p_is_done(tmp_path):
    spec = p1d1(fixed_step_params(tmp_path, 0.1, 0.01, 0.005), mode="pull")
    reqs = hand_made([0.0])
    (rec,) = simulate(spec, timed(reqs), reqs, vocab_size=1000).records
    assert at(rec, "p_done", "d_queued", "transfer_start", "transfer_end", "first_token") == [
        100 * MS, 100 * MS, 100 * MS, 105 * MS, 115 * MS]


def test_a_busy_d_batches_the_second_request_into_its_decode_steps(tmp_path):
    # Both prompts prefilled together in one P step (0-100), both KVs at D at 100 (no latency): one D
    # step 100-110 computes both last prompt tokens, and every later step decodes both.
    spec = p1d1(fixed_step_params(tmp_path, 0.1, 0.01, 0.0))
    reqs = hand_made([0.0, 0.0], output_len=4)
    run = simulate(spec, timed(reqs), reqs, vocab_size=1000)
    assert [[t - ORIGIN_NS for t in r.token_ns] for r in run.records] == [[110 * MS, 120 * MS, 130 * MS,
                                                                           140 * MS]] * 2


def test_the_concurrency_cap_holds_requests_back_until_one_ends(tmp_path):
    spec = p1d1(fixed_step_params(tmp_path, 0.1, 0.01, 0.0))
    reqs = hand_made([0.0, 0.0], output_len=2)
    run = simulate(spec, timed(reqs, concurrency=1), reqs, vocab_size=1000)
    first, second = sorted(run.records, key=lambda r: r.events["arrival"])
    assert at(first, "finish") == [120 * MS] == at(second, "arrival")  # sent when the slot frees


def c90_short() -> tuple[object, BenchConfig]:
    """C90's shape at a quarter of its length on deploy/p8d8-sim.yaml (tests/test_e2e_p8d8_sim.py's load)."""
    prompt, shared = 32 * 1024 + 4, 29 * 1024
    cfg = BenchConfig(input_len=prompt, shared_prefix_ratio=shared / prompt, output_len=64, num_prefixes=8,
                      num_requests=48, max_concurrency=24, request_rate=6.0, progress=False)
    return load_spec(DEPLOY / "p8d8-sim.yaml"), cfg


def test_repeated_decode_steps_give_exactly_the_steps_one_by_one():
    spec, cfg = c90_short()
    prompts = PromptCache(128)
    once = simulate(spec, cfg, prompts=prompts, vocab_size=1000)
    stepped = simulate(spec, cfg, prompts=prompts, repeat_steps=False, vocab_size=1000)
    assert [r.to_json() for r in once.records] == [r.to_json() for r in stepped.records]
    steps = sum(i.steps for i in once.instances)
    assert steps == sum(i.steps for i in stepped.instances)
    assert sum(i.step_events for i in once.instances) < steps / 3  # and it did repeat


def test_a_short_c90_on_p8d8_hits_as_the_workload_expects():
    spec, cfg = c90_short()
    run = simulate(spec, cfg, vocab_size=1000)
    assert len(run.results) == 8 + 8 + 48 and all(r.ok for r in run.results)
    assert run.hit_mismatches == []
    formal = [run.records[i] for i, r in enumerate(run.results) if r.phase == "formal"]
    assert [r.predicted_p_hit_tokens for r in formal] == [r.p_cached_tokens for r in formal]
    assert len({r.prefill_instance for r in formal}) == 8
    assert all(r.output_tokens == 64 and not r.out_of_order() for r in run.records)


def test_a_prefix_family_is_hashed_once_and_checked():
    prompts = PromptCache(16)
    shared = tuple(range(3, 3 + 64))
    a = BenchRequest(0, shared + (500,) * 20, 4, family="f")
    b = BenchRequest(1, shared + (600,) * 20, 4, family="f")
    pa, pb = prompts.prepare(a), prompts.prepare(b)
    fresh = PromptCache(16).prepare(BenchRequest(1, b.prompt_token_ids, 4))
    assert (pb.block_hashes, pb.router_hashes, pb.id_range) == (fresh.block_hashes, fresh.router_hashes,
                                                                fresh.id_range)
    assert pa.block_hashes[:4] == pb.block_hashes[:4] and pa.block_hashes[4] != pb.block_hashes[4]
    # The pools' keys are the router's chain (its indexes take an event's hash as it is), and an
    # id range read from the bytes hashed covers the prompt.
    assert pb.block_hashes == chain_hashes(b.prompt_token_ids, 16)
    assert pb.router_hashes == hittable_hashes(b.prompt_token_ids, 16) and pb.id_range == (3, 600)
    stray = BenchRequest(2, (7,) + shared[1:] + (700,) * 20, 4, family="f")
    with pytest.raises(AssertionError, match="not a prefix family"):
        prompts.prepare(stray)


def test_a_run_written_where_one_was_replaces_it(tmp_path):
    spec = p1d1(fixed_step_params(tmp_path, 0.1, 0.01, 0.005))
    reqs = hand_made([0.0, 0.05])
    run = simulate(spec, timed(reqs), reqs, vocab_size=1000)
    write_virtual_run(run, tmp_path / "out")
    first = (tmp_path / "out" / "timeline" / "requests.jsonl").read_bytes()
    write_virtual_run(run, tmp_path / "out")  # the same place again: the same records, not twice as many
    assert (tmp_path / "out" / "timeline" / "requests.jsonl").read_bytes() == first
    assert len(load_run(tmp_path / "out" / "timeline").records) == 2


def test_ds_tier_load_runs_before_its_pull_and_in_pull_mode_is_its_own_part_of_ttft(tmp_path):
    """D's host tier (decode.engine.host_tier_gib): a prompt D's device cache lost loads its first
    blocks from D's tier in the step that starts D's load (the host link: 20 ms here), then D pulls
    the rest from P; in pull mode that load is on the path after P is done."""
    from pdcluster.router.attribution import attribute

    params = fixed_step_params(tmp_path, 0.1, 0.01, 0.005)
    p = yaml.safe_load(params.read_text())
    p["host_link"] = {"bytes_per_s": 1e20, "latency_s": 0.02}
    params.write_text(yaml.safe_dump(p))
    spec = parse_spec({
        "name": "virtual-p1d1-d-tier", "model": {"path": "/nonexistent"},
        "engine": {"kind": "sim", "block_size": 16, "max_model_len": 4096, "max_num_batched_tokens": 4096,
                   "max_num_seqs": 8},
        "decode": {"engine": {"host_tier_gib": 1}},
        "sim": {"params": str(params), "kv_blocks": 40},  # 39 blocks: two of these prompts, not three
        "transfer": {"mode": "pull"}, "router": {"policy": "round_robin"}})
    reqs = hand_made([0.0, 1.0, 2.0])
    reqs.append(BenchRequest(index=3, prompt_token_ids=reqs[0].prompt_token_ids, output_len=3, arrival_s=3.0))
    run = simulate(spec, timed(reqs), reqs, vocab_size=1000)
    again = max(run.records, key=lambda r: r.events["arrival"])
    assert again.d_tier_tokens > 0, again
    ev = again.events
    assert ev["d_tier_loaded"] - ev["d_tier_load_start"] == 20 * MS and ev["transfer_start"] == ev["d_tier_loaded"]
    assert ev["d_tier_load_start"] == ev["d_queued"] == ev["p_done"]  # pull: D has it once P is done
    assert attribute(again).parts_ns["d_tier_load"] == 20 * MS
