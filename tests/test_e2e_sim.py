"""End to end on a simulated P2D2 cluster (`engine: sim`): the launcher, Ray actors, router,
real KV transfer (scaled payload) and timelines, with the cost model instead of vLLM.

One cluster serves the module. Hits are checked against what each instance served
before (the timeline says which P and D served a request), so they hold whatever P
and D the router picks.
"""

from __future__ import annotations

import random

import httpx
import pytest
import ray
from e2e import (
    FAULT_PREFIX,
    assert_no_kv_in_use,
    cluster_spec_for,
    complete,
    local_prefill_as,
    run_with,
    running_cluster,
    wait_until,
)
from routing_checks import records_of

from pdcluster.router.attribution import attribute
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline import EVENT_ORDER, OPTIONAL_EVENTS

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray]
BLOCK = 128
FULL_KV_BYTES_PER_BLOCK = 14_680_064  # qwen3-0.6b-1dev: 128 tokens x 28 layers x 4,096 B
SCALE = 1024


@pytest.fixture(scope="module")
def cluster():
    spec = cluster_spec_for(
        "e2e-sim", prefill=2, decode=2,
        engine={"kind": "sim", "max_model_len": 16384, "max_num_batched_tokens": 2048, "max_num_seqs": 8},
        sim={"params": "qwen3-0.6b-1dev", "payload_scale": SCALE, "kv_blocks": 256},
        # One block per gRPC message, so the fault injection (after half the blocks) has a middle.
        transfer={"chunk_bytes": 4096},
        router={"policy": "round_robin"})
    with running_cluster(spec) as c:
        yield c


def family(seed: int, n: int = 3000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def served(cluster, prompts: list[list[int]], max_tokens: int = 32) -> list[dict]:
    bodies = []
    for p in prompts:
        r = complete(cluster.url, p, max_tokens)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    return bodies


@pytest.fixture(scope="module")
def family_run(cluster):
    """Three members of one prefix family, one after another, then a second family."""
    base = family(1)
    prompts = [base, base[:2900] + family(2, 100), base[:2900] + family(3, 150), family(4, 1000)]
    bodies = served(cluster, prompts)
    records = {r.request_id: r for r in run_with(cluster.run_dir, [b["id"] for b in bodies]).records}
    return prompts, bodies, [records[b["id"]] for b in bodies]


def test_requests_succeed_with_every_token(family_run):
    _, bodies, records = family_run
    for body, rec in zip(bodies, records):
        assert len(body["choices"][0]["token_ids"]) == 32 and body["choices"][0]["finish_reason"] == "length"
        assert rec.error is None and rec.output_tokens == 32


def test_family_hits_on_the_p_and_the_d_that_served_it_before(family_run):
    prompts, bodies, records = family_run
    seen_p, seen_d = set(), set()
    p_hits = d_hits = 0
    for i, (prompt, body, rec) in enumerate(zip(prompts, bodies, records)):
        pd = body["usage"]["pd"]
        shared = 0 if i in (0, 3) else 2900 // BLOCK * BLOCK  # 22 full blocks of the family
        want_p = shared if rec.prefill_instance in seen_p else 0
        want_d = shared if rec.decode_instance in seen_d else 0
        assert (pd["p_cached_tokens"], pd["d_cached_tokens"]) == (want_p, want_d), (i, rec.prefill_instance,
                                                                                    rec.decode_instance, pd)
        assert pd["transferred_tokens"] == len(prompt) - want_d
        p_hits += want_p > 0
        d_hits += want_d > 0
        if i < 3:
            seen_p.add(rec.prefill_instance)
            seen_d.add(rec.decode_instance)
    # Three family members over two P and two D: some instance served two of them.
    assert p_hits >= 1 and d_hits >= 1


def test_kv_bytes_really_moved_scaled(cluster, family_run):
    _, _, records = family_run
    blocks = 0
    for rec in records:
        (group,) = rec.transfer_groups
        want = -(-rec.prompt_tokens // BLOCK) - rec.d_cached_tokens // BLOCK
        assert group.blocks == want and group.bytes == want * FULL_KV_BYTES_PER_BLOCK  # modelled, full size
        blocks += want
    stats = [ray.get(d.actor.sim_stats.remote()) for d in cluster.decode]
    row = -(-FULL_KV_BYTES_PER_BLOCK // SCALE)
    assert all(s.payload_bytes_per_block == {"full_kv": row} for s in stats)
    assert sum(s.received_bytes for s in stats) == blocks * row


def test_timelines_are_complete_and_ordered(family_run):
    _, _, records = family_run
    for rec in records:
        assert [e for e in EVENT_ORDER if e not in rec.events and e not in OPTIONAL_EVENTS] == [], rec.request_id
        assert rec.out_of_order() == [], (rec.request_id, rec.out_of_order())
        att = attribute(rec)
        assert att.complete and all(v >= 0 for v in att.parts_ns.values()), att.parts_ns
        # Tokens come in batches but keep their own times: one per decode step, not one per batch.
        assert len(set(rec.token_ns)) == rec.output_tokens


def test_broken_transfer_ends_in_an_error_and_frees_its_blocks(cluster, family_run):
    # The router names it FAULT_PREFIX + "sim": P breaks its transfer halfway.
    r = complete(cluster.url, family(9, 1500), 8, request_id=FAULT_PREFIX.removeprefix("cmpl-") + "sim")
    assert r.status_code == 502, r.text
    ok = complete(cluster.url, family(10, 500), 8)
    assert ok.status_code == 200, ok.text


def test_a_client_gone_mid_stream_ends_its_request_on_d(cluster, family_run):
    # 2,000 tokens at the model's ~33 ms a step: over a minute, unless D aborts the request.
    body = {"prompt": family(11, 500), "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30,
                      headers={"X-Request-Id": "gone-mid-stream"}) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: {"))
    assert_no_kv_in_use(cluster, 10)
    (rec,) = records_of(cluster, ["cmpl-gone-mid-stream"])
    assert rec.error and "client went away" in rec.error and rec.output_tokens < 2000


def test_local_prefills_slow_the_decodes_they_share_steps_with_and_the_summary_measures_it(cluster, family_run):
    """D prefills short cold prompts itself (router.local_prefill, threshold 2,048) while it
    decodes long requests: those steps are mixed (qwen3-0.6b-1dev: 38 ms with a 2,000-token
    chunk vs 33 ms decoding alone), and the summary's ITL during local prefills shows it."""
    import threading

    from pdcluster.router.local_views import local_summary
    from pdcluster.router.timeline_views import format_summary, summarize

    with local_prefill_as(cluster, policy="short_remainder", max_tokens=2048):
        long = [threading.Thread(target=served, args=(cluster, [family(40 + i, 2100)], 300)) for i in range(4)]
        for t in long:
            t.start()
        wait_until(lambda: sum(ray.get(d.actor.load.remote()).running for d in cluster.decode) == 4, 60,
                   interval=0.05, what="all four decoding (2,100 > 2,048: through P)")
        local_bodies = served(cluster, [family(60 + i, 2000) for i in range(20)], max_tokens=1)
        for t in long:
            t.join()
    assert all(b["usage"]["pd"]["local_prefill"] for b in local_bodies)
    s = local_summary(load_run(cluster.run_dir).records)
    assert s.local == 20 and s.reasons["short_remainder"] == 20 and s.remote >= 4
    during, without = s.itl_during_local, s.itl_without_local
    assert during.n >= 20 and without.n >= 100
    ratio = during.mean_ms / without.mean_ms
    print(f"ITL during local prefills {during.mean_ms:.1f} ms ({during.n}), without {without.mean_ms:.1f} ms "
          f"({without.n}): {ratio:.2f}x")
    assert 1.05 < ratio < 1.6, f"ITL during local prefills {during.mean_ms:.1f} ms vs {without.mean_ms:.1f} ms"
    text = format_summary(summarize(load_run(cluster.run_dir)))
    assert "local prefill: 20 of" in text and "during a local prefill:" in text


def test_every_block_is_free_at_the_end(cluster, family_run):
    assert_no_kv_in_use(cluster)
    for inst in cluster.instances:
        counts = ray.get(inst.actor.check_blocks.remote())  # raises if an invariant broke
        assert counts["held"] == 0 and counts["free"] == counts["total"], (inst.name, counts)
