"""How long a tiny-Qwen3 P1D1 takes from `running_cluster` to serving: engine start on CPU.

Each round starts a fresh local Ray and cluster (P bound to core 0, D to core 1, as the e2e
tests run them), times it until every instance is healthy, serves one request, and stops
it. Compare trees by running it under each (PYTHONPATH=<the other tree's parent>); figures in
bench/README.md ("Engine start on CPU").

    .venv/bin/python -m pdcluster.bench.engine_start --rounds 3

With --reference, each round instead times the single reference engines of the e2e tests (their
Ray actor to its first greedy answer), one of each kind in turn: ReferenceEngine (AsyncLLM, its
engine core in a process of its own, as the cluster's) and GreedyReference (in the actor).

    .venv/bin/python -m pdcluster.bench.engine_start --reference --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def one_round(model: str, port: int) -> tuple[float, float]:
    """(seconds to healthy, seconds to stop)."""
    import httpx

    from pdcluster.cluster.launch import running_cluster
    from pdcluster.proto.spec import parse_spec

    spec = parse_spec({
        "name": "bench-engine-start", "model": {"path": model, "tiny": {"arch": "qwen3", "seed": 0}},
        "engine": {"max_model_len": 8192, "max_num_batched_tokens": 8192, "dtype": "float32"},
        "prefill": {"resources": {"cpu_bind": ["0"]}}, "decode": {"resources": {"cpu_bind": ["1"]}},
        "router": {"port": port + 9, "kv_events_port": port + 2}, "transfer": {"base_port": port},
    }, base_dir=Path.cwd())
    t0 = time.monotonic()
    with running_cluster(spec) as cluster:
        up = time.monotonic() - t0
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                       json={"prompt": [5] * 300, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        t1 = time.monotonic()
    return up, time.monotonic() - t1


def reference_round(model: str) -> dict[str, float]:
    """Seconds from creating each kind of reference actor to its first greedy answer (a fresh
    local Ray for the round); both must give the same tokens."""
    import ray

    from pdcluster.cluster.reference_engine import GreedyReference, ReferenceEngine

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        took, tokens = {}, {}
        for cls in (ReferenceEngine, GreedyReference):
            t0 = time.monotonic()
            actor = ray.remote(num_cpus=0)(cls).remote(model, "0")
            tokens[cls.__name__] = ray.get(actor.greedy.remote(list(range(5, 600)), 8))
            took[cls.__name__] = time.monotonic() - t0
            ray.kill(actor)
        assert len({tuple(t) for t in tokens.values()}) == 1, tokens
        return took
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=".pdcluster/models/tiny-qwen3")
    ap.add_argument("--port", type=int, default=18700, help="first of 10 ports the cluster binds")
    ap.add_argument("--reference", action="store_true", help="time the reference engines instead")
    a = ap.parse_args()
    if a.reference:
        for k in range(a.rounds):
            took = reference_round(a.model)
            print(f"round {k + 1}: " + ", ".join(f"{name} {s:.1f} s" for name, s in took.items()), flush=True)
        return
    ups = []
    for k in range(a.rounds):
        up, down = one_round(a.model, a.port)
        ups.append(up)
        print(f"round {k + 1}: up {up:.1f} s, down {down:.1f} s", flush=True)
    print(f"up: median {statistics.median(ups):.1f} s, min {min(ups):.1f} s over {len(ups)} rounds")


if __name__ == "__main__":
    main()
