"""What recording timelines costs: throughput with recording on vs off, in one run.

One P1D1 cluster; a closed-loop load (C requests in flight) through the router;
rounds alternate recording on and off (ABAB...), so drift on this noisy 2-core
machine hits both alike. "Off" removes what recording adds per request: the
record's JSON line and file append, and the Prometheus observations. Also times
that per-request work alone (no engines), as the floor of the overhead.

usage: python -m pdcluster.bench.timeline_overhead [--rounds 6] [--requests 48] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path


async def _round(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Requests per second for this round."""
    import httpx

    queue = list(prompts)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop()
            r = await client.post(f"{url}/v1/completions", timeout=300, json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()

    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return len(prompts) / (time.perf_counter() - t0)


def per_record_cost_us(n: int = 2000, output_tokens: int = 16) -> float:
    """Microseconds to append one realistic record and observe it in the metrics."""
    from pdcluster.router.metrics import RouterMetrics
    from pdcluster.router.run_store import RunMeta, RunStore
    from pdcluster.router.timeline import EVENT_ORDER, GroupTransfer, RequestRecord

    meta = RunMeta("bench", 0, 0, {}, {}, [])
    with tempfile.TemporaryDirectory() as d:
        store = RunStore(Path(d) / "run", meta)
        metrics = RouterMetrics(lambda: {"prefill-0": 0, "decode-0": 0})
        rec = RequestRecord("cmpl-" + "0" * 32, prompt_tokens=4096, output_tokens=output_tokens, p_cached_tokens=3584,
                            transfer_groups=[GroupTransfer(0, 4, 1 << 20)],
                            events={e: i * 1_000_000 for i, e in enumerate(EVENT_ORDER)},
                            token_ns=[123_456_789_000_000 + i * 4_000_123 for i in range(output_tokens)])
        t0 = time.perf_counter()
        for _ in range(n):
            store.append(rec)
            metrics.observe(rec)
        cost = (time.perf_counter() - t0) / n * 1e6
        store.close()
    return cost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6, help="rounds per mode")
    ap.add_argument("--requests", type=int, default=48, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--record-only", action="store_true", help="only time the per-record work (no cluster)")
    a = ap.parse_args()
    if a.record_only:
        for tokens in (16, 1024):
            print(f"per-record work, {tokens} output tokens: "
                  f"{statistics.median(per_record_cost_us(500, tokens) for _ in range(5)):.0f} us")
        return

    import ray

    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.proto.names import NAMESPACE
    from pdcluster.proto.spec import parse_spec

    spec = parse_spec({
        "name": "bench-overhead", "model": {"path": ".pdcluster/models/tiny-qwen3", "tiny": {"arch": "qwen3"}},
        "engine": {"dtype": "float32"}, "router": {"port": 18998}, "transfer": {"base_port": 18950},
        "prefill": {"resources": {"cpu_bind": ["0"]}}, "decode": {"resources": {"cpu_bind": ["1"]}},
    }, base_dir=Path.cwd())
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    cluster = build_cluster(spec)
    rng = random.Random(0)
    try:
        def prompts():  # fresh prompts each round: no round is favoured by the prefix caches
            return [[rng.randrange(3, 1000) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]

        asyncio.run(_round(cluster.url, prompts()[: a.concurrency], a.concurrency, a.max_tokens))  # warm-up
        rates: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * a.rounds):
            on = i % 2 == 0
            cluster.each_router("set_recording", on)
            rates[on].append(asyncio.run(_round(cluster.url, prompts(), a.concurrency, a.max_tokens)))
            print(f"round {i:2d} recording {'on ' if on else 'off'}: {rates[on][-1]:.2f} req/s", flush=True)
        cluster.each_router("set_recording", True)
    finally:
        teardown(cluster)
        ray.shutdown()
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    cost = per_record_cost_us()
    print(f"median throughput: on {on:.2f} req/s, off {off:.2f} req/s, overhead {100 * (1 - on / off):+.2f}% "
          f"(round-to-round spread {100 * (max(rates[False]) - min(rates[False])) / off:.0f}%)")
    print(f"recording work per request: {cost:.1f} us; at {off:.1f} req/s that is {cost * off / 1e4:.2f}% "
          f"of one core")


if __name__ == "__main__":
    main()
