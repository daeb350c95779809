"""P/D TTFT vs a single engine, per prompt length, on real engines (P1D1 + a reference).

Same measurements as ../shared/probes/nixl (vLLM's NixlConnector on this
machine), so the two transports compare side by side:
  P prefill   P's prefill call (max_tokens=1), seen by the caller
  D TTFT      D's decode call until its first token: KV pull + last-token recompute
  PD TTFT     P prefill + handoff + D TTFT, as the P/D request path runs it
  single      a plain engine (no connector, prefix caching off) to its first token

usage: python -m pdcluster.bench.pd_ttft [--sizes 1024,4096,8192,16384] [--trials 3] [--dtype bfloat16]
                                         [--connector pdc|nixl] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

COLUMNS = ("p_prefill_ms", "d_ttft_ms", "pd_ttft_ms", "single_ttft_ms")


def measure(cluster, reference, prompt: list[int], rid: str) -> dict:
    import ray

    from pdcluster.cluster.messages import DecodeRequest, PrefillRequest, SamplingSpec

    p, d = cluster.prefill[0].actor, cluster.decode[0].actor
    s = SamplingSpec(max_tokens=2, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    pre = ray.get(p.prefill.remote(PrefillRequest(rid, prompt, s)))
    t1 = time.perf_counter()
    stream = d.decode.options(num_returns="streaming").remote(DecodeRequest(rid, prompt, s, pre.handle))
    first = None
    for ref in stream:
        delta = ray.get(ref)
        if first is None and delta.new_token_ids:
            first = time.perf_counter()
    # Ours reports what it moved; NIXL does not (then D must have counted the whole prompt as cached).
    if delta.transfer is not None:
        assert delta.transfer.transferred_tokens == len(prompt), delta.transfer
    else:
        assert delta.num_cached_tokens == len(prompt), delta.num_cached_tokens
    single = ray.get(reference.ttft.remote(prompt))
    kv_bytes = sum(delta.transfer.bytes_per_group) if delta.transfer else 0
    return {"p_prefill_ms": (t1 - t0) * 1e3, "d_ttft_ms": (first - t1) * 1e3, "pd_ttft_ms": (first - t0) * 1e3,
            "single_ttft_ms": single * 1e3, "kv_bytes": kv_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096,8192,16384")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny seed-0 Qwen3)")
    ap.add_argument("--dtype", default="float32", help="engine dtype (the NIXL probe ran bfloat16)")
    ap.add_argument("--connector", default="pdc", choices=["pdc", "nixl"], help="transfer.connector")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    max_len = max(sizes) + 128

    import ray

    from pdcluster.cluster.launch import NAMESPACE, build_cluster, teardown
    from pdcluster.cluster.reference_engine import ReferenceEngine
    from pdcluster.cluster.spec import parse_spec

    model = a.model or ".pdcluster/models/tiny-qwen3"
    spec = parse_spec({
        "name": "bench-pd-ttft", "model": {"path": model, "tiny": {"arch": "qwen3", "seed": 0}},
        "engine": {"dtype": a.dtype, "max_model_len": max_len, "max_num_batched_tokens": max_len},
        "prefill": {"resources": {"cpu_bind": ["0"]}}, "decode": {"resources": {"cpu_bind": ["1"]}},
        "router": {"port": 18999}, "transfer": {"base_port": 18900, "connector": a.connector},
    }, base_dir=Path.cwd())
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    cluster = build_cluster(spec)
    reference = ray.remote(num_cpus=0)(ReferenceEngine).remote(spec.model.path, "0", max_len, a.dtype)
    try:
        rng = random.Random(12345)
        warm = [rng.randrange(3, 1000) for _ in range(1000)]
        measure(cluster, reference, warm, "warmup")  # first gRPC connection, first forward passes
        results = {}
        print(f"{'tokens':>7} " + " ".join(f"{c:>15}" for c in COLUMNS) + f" {'KV MB':>8} {'GB/s (D TTFT)':>14}")
        for n in sizes:
            rows = []
            for trial in range(a.trials):
                prompt = [rng.randrange(3, 1000) for _ in range(n)]  # fresh: no prefix hit anywhere
                rows.append(measure(cluster, reference, prompt, f"b{n}-{trial}"))
            med = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
            med["kv_bytes"] = rows[0]["kv_bytes"]
            results[n] = med
            gbs = med["kv_bytes"] / (med["d_ttft_ms"] / 1e3) / 1e9  # 0 with NIXL: it reports no bytes
            print(f"{n:>7} " + " ".join(f"{med[c]:>15.1f}" for c in COLUMNS)
                  + f" {med['kv_bytes'] / 1e6:>8.1f} {gbs:>14.2f}", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"args": vars(a), "medians": results}, f, indent=1)
    finally:
        teardown(cluster)
        ray.shutdown()


if __name__ == "__main__":
    main()
