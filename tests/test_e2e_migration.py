"""End to end on real engines, P2D2: a decode instance killed mid-stream, its request moved to
the other D (router/migration.py), the client's stream (the official openai client) going on
with exactly the single engine's tokens, and no KV block left in use anywhere afterwards.

The cluster is test_e2e_kv_events's (tests/e2e.py p2d2_small_pool_spec), its router switched to
least_load here; the reference engine is the session's."""

from __future__ import annotations

import random
import threading

import openai
import pytest
import ray
from e2e import (
    assert_no_kv_in_use,
    health,
    p2d2_small_pool_spec,
    shared_cluster,
    shared_reference,
    wait_until,
)

from pdcluster.router.run_store import load_run

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p2d2")]
# Within a D's pool of P2D2_POOL_BLOCKS: 6 blocks of 128 tokens.
PROMPT_TOKENS, MAX_TOKENS = 300, 400


@pytest.fixture(scope="module")
def cluster():
    cluster = shared_cluster("p2d2", p2d2_small_pool_spec)
    cluster.each_router("set_policy", "least_load")
    yield cluster
    cluster.each_router("set_policy", cluster.spec.router.policy)


@pytest.fixture(scope="module")
def reference(cluster):
    return shared_reference()


def kill_process_tree(pid: int) -> None:
    import psutil

    proc = psutil.Process(pid)
    for p in [*proc.children(recursive=True), proc]:
        p.kill()


def serving_decode(cluster):
    """The D instance running a request now (its engine's running count)."""
    busy = [d for d in cluster.decode if ray.get(d.actor.load.remote()).running > 0]
    return busy[0] if len(busy) == 1 else None


def test_a_decode_killed_mid_stream_the_stream_goes_on_with_the_single_engines_tokens(cluster, reference):
    prompt = [random.Random(11).randrange(3, 1000) for _ in range(PROMPT_TOKENS)]
    want = ray.get(reference.greedy.remote(prompt, MAX_TOKENS))
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    got, usage, killed = [], None, None
    for chunk in stream:
        for choice in chunk.choices:
            got += choice.model_extra.get("token_ids") or []
        usage = chunk.usage or usage
        if killed is None and len(got) >= 40:  # mid-stream: D is decoding it now
            victim = wait_until(lambda: serving_decode(cluster), 10, interval=0.05, what="the D serving it")
            killed = victim.name
            kill_process_tree(ray.get(victim.actor.info.remote()).pid)  # as a lost host: actor and engine at once
    assert killed is not None, "the stream ended before 40 tokens: nothing was killed mid-stream"
    assert got == want, f"first difference at token {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    assert usage.completion_tokens == MAX_TOKENS and usage.model_extra["pd"]["migrations"] == 1
    rec = next(r for r in reversed(load_run(cluster.run_dir).records) if r.migrations)
    [m] = rec.migrations
    assert m.role == "decode" and m.lost == killed and m.to != killed and m.tokens_sent >= 40
    assert rec.error is None and rec.output_tokens == MAX_TOKENS
    # Ray restarts the killed D; then every instance holds no KV block for a finished request.
    wait_until(lambda: all(health(cluster).values()), 180, interval=2, what=f"{killed} back")
    assert_no_kv_in_use(cluster)


def test_requests_in_flight_when_a_decode_dies_all_finish_whole(cluster, reference):
    """Several streams on both D, one D killed: every request ends with all its tokens (the lost
    D's moved to the other), none with an error, and the tokens are the single engine's."""
    rng = random.Random(12)
    # Two blocks each: all four fit the surviving D's pool (P2D2_POOL_BLOCKS), none is preempted.
    prompts = [[rng.randrange(3, 1000) for _ in range(120)] for _ in range(4)]
    wants = [ray.get(reference.greedy.remote(p, 120)) for p in prompts]
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)
    results: dict[int, object] = {}

    def one(i):
        try:
            r = client.completions.create(model="tiny-qwen3", prompt=prompts[i], max_tokens=120, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            results[i] = r.choices[0].model_extra["token_ids"]
        except Exception as err:  # noqa: BLE001  (the assertion below names it)
            results[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    wait_until(lambda: all(ray.get(d.actor.load.remote()).running > 0 for d in cluster.decode), 30,
               interval=0.05, what="both D decoding")  # each engine runs one: its KV is in, it decodes
    victim = cluster.decode[0]
    kill_process_tree(ray.get(victim.actor.info.remote()).pid)
    for t in threads:
        t.join(timeout=120)
    assert all(results.get(i) == wants[i] for i in range(len(prompts))), {
        i: (r if isinstance(r, Exception) else f"{len(r)} tokens, equal: {r == wants[i]}") for i, r in results.items()}
    # Ray's restart of a killed D is the test above's; the survivors hold no KV block.
    for inst in cluster.instances:
        if inst is not victim:
            wait_until(lambda: ray.get(inst.actor.load.remote()).kv_cache_usage == 0.0, 15,
                       what=f"{inst.name} KV usage back to 0")
