"""Unit tests of the router benchmarks' helpers: bench/routing_decisions.py, bench/router_overhead.py and
its backends (bench/fake_pd_backend.py, bench/instant_engine.py). No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from pdcluster.bench import fake_pd_backend as fake
from pdcluster.bench import router_overhead as ro
from pdcluster.bench import router_profile as prof
from pdcluster.bench import router_systems as systems
from pdcluster.bench import routing_decisions as rd
from pdcluster.bench import wrk_load
from pdcluster.bench.instant_engine import instant_deltas
from pdcluster.proto.messages import DecodeRequest, SamplingSpec
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


def test_run_picker_routes_through_the_wired_picker_and_feed():
    results = {r.policy: r for r in rd.run_picker(["round_robin", "prefix_aware"], n=12, input_len=7 * BS, seed=2,
                                                  warmup=1, in_flight=0, max_tokens=2, n_prefill=2, n_decode=3,
                                                  families=4, prefix_tokens=5 * BS, block_size=BS,
                                                  blocks_per_event=2)}
    aware = results["prefix_aware (InstancePicker + KvEventFeed)"]
    assert aware.decisions == 12 and aware.owner_hits == 1.0
    assert "round_robin (InstancePicker + KvEventFeed)" in results
    assert "| prefix_aware (InstancePicker + KvEventFeed) |" in rd.format_table([aware])


def test_summarize_counts_decisions_sent_to_the_owner():
    decs = [rd.Decision("prefill-0", "decode-0", 0, 0.001, 0.001, 0.002),
            rd.Decision("prefill-1", "decode-0", 0, 0.001, 0.001, 0.002)]
    r = rd.summarize("least_load", decs, ["prefill-0", "prefill-0"])
    assert r.owner_hits == 0.5
    assert round(r.decisions_per_s) == 250
    assert "| least_load | 250.0 | 4.00 | 1.00 |" in rd.format_table([r])


# ---- bench/router_overhead.py (+ router_systems.py, wrk_load.py), bench/fake_pd_backend.py, bench/instant_engine.py ---------------

WRK_OUTPUT = """Running 8s test @ http://127.0.0.1:1/v1/completions
  1 threads and 32 connections
{"requests": 8000, "duration_us": 4000000, "p50_us": 3500, "p90_us": 5000, "p99_us": 9000, "mean_us": 3900.5, "errors": 1, "non_2xx": 2}
"""


def test_wrk_script_posts_the_body_as_a_lua_string():
    body = wrk_load.request_body("tiny", stream=True)
    script = wrk_load.wrk_script(body)
    literal = next(line for line in script.splitlines() if line.startswith("wrk.body = ")).removeprefix("wrk.body = ")
    assert json.loads(json.loads(literal)) == body  # a JSON string literal is a valid Lua one
    assert 'wrk.method = "POST"' in script and "latency:percentile(50)" in script


def test_parse_wrk_reads_the_result_line():
    r = wrk_load.parse_wrk(WRK_OUTPUT, client_cpu_s=1.0)
    assert (r.requests, r.rps, r.p50_ms, r.p99_ms, r.errors, r.non_2xx) == (8000, 2000.0, 3.5, 9.0, 1, 2)
    assert r.client_cpu_share == 0.25
    with pytest.raises(ValueError, match="no result line"):
        wrk_load.parse_wrk("Running 8s test\n")


def measurement(system: str, setting: ro.Setting, requests: int, proxy_cpu_s: float = 0.5) -> ro.Measurement:
    load = wrk_load.LoadResult(requests, 1.0, 2.0, 3.0, 4.0, 2.5, 0, 0, client_cpu_s=0.1)
    return ro.Measurement(system, setting, load, proxy_cpu_s, 0.25)


def test_median_measurements_keeps_the_median_round_per_system_and_setting():
    c32 = ro.Setting(False, 32)
    ms = [measurement("a", c32, n) for n in (300, 100, 200)] + [measurement("b", c32, 50)]
    assert sorted((m.system, m.load.requests) for m in ro.median_measurements(ms)) == [("a", 200), ("b", 50)]


def test_format_table_shows_throughput_at_c32_latency_at_c1_and_cpu_per_request():
    c32, c1 = ro.Setting(False, 32), ro.Setting(False, 1)
    table = ro.format_table([measurement("a", c32, 1000), measurement("a", c1, 400)], [c32, c1])
    assert "| non-stream c32 req/s | non-stream c1 p50 ms |" in table
    assert "| a | 1,000 | 2.00 | 500 | 250 | 10% | 0 |" in table


def test_pdc_variants_toggle_recording_and_batching_on_the_first_policy_only():
    names = [v.name for v in systems.pdc_variants(["round_robin", "prefix_aware"], batched_tokens=4)]
    assert names == ["pdcluster round_robin rec on", "pdcluster round_robin rec off",
                     "pdcluster prefix_aware rec on", "pdcluster round_robin rec on, D 4 tokens/delta"]
    assert [(v.policy, v.tokens_per_delta) for v in systems.pdc_variants([])] == [(None, 1), (None, 1), (None, 4)]


def decode_request(max_tokens: int) -> DecodeRequest:
    return DecodeRequest("r1", [5, 6, 7], SamplingSpec(max_tokens=max_tokens), None)


def test_instant_deltas_stream_max_tokens_and_finish_on_the_last():
    one = instant_deltas(decode_request(4))
    assert [d.new_token_ids for d in one] == [[5], [6], [7], [5]]
    assert [d.finish_reason for d in one] == [None, None, None, "length"]
    assert one[-1].transfer is not None and one[0].transfer is None
    three = instant_deltas(decode_request(4), tokens_per_delta=3)
    assert [d.new_token_ids for d in three] == [[5, 6, 7], [5]]


def test_fake_backend_answers_the_p_leg_with_kv_transfer_params():
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    out = json.loads(fake.completion_answer(body, chat=False, request_no=3, engine_id="fake-p", port=9).body)
    assert out["kv_transfer_params"]["do_remote_prefill"] is True
    assert out["kv_transfer_params"]["remote_engine_id"] == "fake-p"
    assert out["choices"][0]["text"] == fake.TOKEN_TEXT
    plain = json.loads(fake.completion_answer({"max_tokens": 2}, chat=True, request_no=4, engine_id="d", port=9).body)
    assert "kv_transfer_params" not in plain
    assert plain["choices"][0]["message"]["content"] == fake.TOKEN_TEXT * 2


def test_fake_backend_streams_one_event_per_token_then_usage_and_done():
    answer = fake.completion_answer({"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
                                    chat=False, request_no=0, engine_id="d", port=9)
    events = [c.decode().removeprefix("data: ").strip() for c in answer.chunks]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert [p["choices"][0]["finish_reason"] for p in parsed[:3]] == [None, None, "length"]
    assert parsed[3]["usage"]["completion_tokens"] == 3


def test_fake_backend_serves_keep_alive_http():
    async def scenario():
        server = await asyncio.get_running_loop().create_server(
            lambda: fake._Connection(fake.FakeServer("fake-d", 0)), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.get("/health")).status_code == 200
                plain = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                streamed = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
                missing = await client.post("/nowhere", json={})
        finally:
            server.close()
        return plain, streamed, missing

    plain, streamed, missing = asyncio.run(scenario())
    assert plain.json()["choices"][0]["text"] == fake.TOKEN_TEXT * 2
    assert streamed.text.count("data: ") == 3 and streamed.text.endswith("data: [DONE]\n\n")
    assert missing.status_code == 404


RAW_STACKS = """\
Thread.run (threading.py:982);RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:422) 5
Thread.run (threading.py:982);PDDispatcher._prefill (pdcluster/router/pd_dispatch.py:205);ActorMethod._remote (ray/actor.py:1178) 3
Thread.run (threading.py:982);ActorMethod._remote (ray/actor.py:1178);SerializationContext.serialize (ray/_private/serialization.py:801) 2
Thread.run (threading.py:982);build_app.<locals>.completions (pdcluster/router/openai_api.py:347);PreTrainedTokenizerBase.encode (transformers/tokenization_utils_base.py:2279) 4
 6
_bootstrap (threading.py:1002);Worker.main_loop (ray/_private/worker.py:1069) 9
"""


def test_fold_assigns_each_stack_to_its_most_specific_cost():
    samples = prof.fold(RAW_STACKS.splitlines())
    assert samples == {"HTTP server + ASGI framework": 5, "Ray: submit prefill/decode calls": 3,
                       "Ray: (de)serialize messages": 2, "tokenize the prompt": 4, prof.NATIVE: 6}
    assert prof.categorize(["main (x.py:1)"]) == prof.OTHER
    own = "pdcluster request path, own code"  # as py-spy names an editable install's files, and an installed one's
    assert prof.categorize(["PDDispatcher.generate (router/pd_dispatch.py:97)"]) == own
    assert prof.categorize(["PDDispatcher.generate (pdcluster/router/pd_dispatch.py:97)"]) == own


def test_profile_spreads_cpu_per_request_by_sample_share():
    p = prof.Profile("router", {"tokenize the prompt": 1, prof.OTHER: 3}, rate_hz=100, duration_s=1.0,
                     requests=100, cpu_s=0.4)
    assert p.us_per_request("tokenize the prompt") == pytest.approx(1000.0)
    table = prof.format_profiles([p])
    assert "| tokenize the prompt | 25.0% | 1,000 |" in table
    assert "| total | 4 samples | 4,000 CPU us/req |" in table


def test_ray_floor_result_reports_percentiles_of_the_latencies():
    r = systems.ray_floor_result([0.004, 0.001, 0.002, 0.003], duration_s=2.0, cpu_s=0.0)
    assert (r.requests, r.rps, r.p50_ms, r.p99_ms) == (4, 2.0, 3.0, 4.0)
    assert r.mean_ms == pytest.approx(2.5)


@pytest.mark.parametrize("recording", [True, False])
def test_router_floor_in_process_serves_requests_through_the_real_app(recording):
    from e2e import tiny_model_dir

    from pdcluster.bench import router_floors as floors

    model_dir = tiny_model_dir()
    app = floors.in_process_app(model_dir, recording)
    body = json.dumps(wrk_load.request_body("tiny-qwen3", stream=False)).encode()
    assert asyncio.run(floors.asgi_requests(app, body, 20)) > 0  # asserts every answer was a 200


def test_router_floor_instant_decode_answers_max_tokens_of_the_prompt():
    from pdcluster.bench.router_floors import InstantChannel

    # A request the router does not stream (final_only): one delta, as the router_overhead engines send it.
    call = InstantChannel().call("decode", DecodeRequest("r", [5, 6], SamplingSpec(max_tokens=3, final_only=True),
                                                         None))
    delta = asyncio.run(call.next())
    assert delta.new_token_ids == [5, 6, 5] and delta.finish_reason == "length" and call.done
    assert asyncio.run(call.next()) is None
    streamed = InstantChannel().call("decode", DecodeRequest("r", [5, 6], SamplingSpec(max_tokens=3), None))
    assert streamed.has_reply and len(streamed.items) == 3  # one delta a token otherwise


def test_router_passes_parse_what_each_pass_sets():
    from pdcluster.bench.router_passes import Pass

    p = Pass.parse("local:1024+pending:off")
    assert (p.local.policy, p.local.max_tokens, p.track_pending) == ("short_remainder", 1024, False)
    assert Pass.parse("local:off").local.policy == "never" and Pass.parse("local:off").track_pending is None
    assert Pass.parse("pending:on").local is None
    for bad in ("local:0", "local:on", "pending:maybe", "fast"):
        with pytest.raises(SystemExit, match="--passes"):
            Pass.parse(bad)
