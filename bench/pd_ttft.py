"""P/D TTFT vs a single engine, cold and warm, per shared-prefix length (the first seed's table in PD mode).

The protocol of ../shared/seeds/000 (section 8), on a real P1D1 cluster through
its router and on one plain engine with prefix caching on:
  A = [common prefix of n tokens][suffix A], B = [same prefix][suffix B] (14 tokens each);
  cold: reset every prefix cache, run A, reset again, time B;
  warm: reset, run A, time B (P and D, or the single engine, hold the prefix).
For the cluster it reports, per request, the client's TTFT and the time from
P's prefill ending to D's first token ("after P": transfer not hidden + D's
wait + D's last-token step; negative when D answers before P's own reply, as a
push allows), from the request's timeline. pdc runs push and pull over each
transport on the same cluster; `--connector nixl` runs vLLM's NixlConnector.

With `--sim PARAMS` the cluster is simulated (engine: sim): `--sim qwen3-0.6b-1dev` replays the
seed's own setting, and the "P engine" rows (P's queued to first token, from the timeline) are
what the seed timed on one device.

usage: python -m pdcluster.bench.pd_ttft [--sizes 1024,4096,8192,16384] [--trials 3] [--dtype bfloat16]
                                         [--connector pdc|nixl] [--transports grpc,torch_dist] [--out FILE.json]
                                         [--sim qwen3-0.6b-1dev] [--local-prefill off,on]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

SUFFIX = 14


@dataclass(frozen=True)
class Row:
    tokens: int  # shared prefix
    setup: str  # "pdc push" | "pdc pull" | "nixl pull" | "single"
    cache: str  # "cold" | "warm"
    ttft_ms: float  # client (cluster) or engine (single) TTFT
    after_p_ms: float | None  # first D token - P's prefill end (cluster only)
    p_cached: int
    d_cached: int
    local: bool = False  # D prefilled it itself (router.local_prefill)
    parts: dict[str, float] | None = None  # ms, PARTS's names: where a D-alone or single-engine TTFT went


# Where a warm TTFT goes, in order (ms): the client's request to the router's handler (the
# client's JSON encoding, HTTP), the router (body, parse, hashing, pick), on to the engine core's
# queue (request channel, D's actor, vLLM's input processing and IPC), the engine (queued to
# the first token's step), that token back to the router, and on to the client (SSE).
# The single engine, in-process, has only the middle three.
PARTS = ("http_in", "router", "to_engine_core", "engine", "to_router", "http_out")


_CLIENT = None


def _client():
    """One HTTP client for the whole run, its connection kept open, as a serving client does:
    a new httpx client per request costs ~24 ms before the request leaves (measured here),
    more than the router's whole path (arrival to first token of a warm 1K request: ~12 ms)."""
    global _CLIENT
    if _CLIENT is None:
        import httpx

        _CLIENT = httpx.Client(timeout=600)
    return _CLIENT


class Streamed(NamedTuple):
    rid: str
    ttft_ms: float
    usage: dict
    client_ns: tuple[int, int]  # (sent, first token) on time.monotonic_ns, the router's and engines' clock here
    tokens: list[int]


def stream_ttft(url: str, prompt: list[int], max_tokens: int = 2) -> Streamed:
    """One greedy streamed completion: its id, client TTFT, usage, send and first-token times, and
    its tokens.

    TTFT counts from the request leaving: its JSON is encoded before the clock starts (the
    client's own CPU, 0.85 ms for a 16K-token prompt with json.dumps)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    sent_ns, first_ns = time.monotonic_ns(), 0
    ttft, rid, usage, tokens = None, None, {}, []
    with _client().stream("POST", f"{url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            rid = event["id"]
            if ttft is None and event["choices"] and event["choices"][0].get("token_ids"):
                ttft, first_ns = (time.perf_counter() - t0) * 1e3, time.monotonic_ns()
            for choice in event["choices"]:
                tokens += choice.get("token_ids") or []
            usage = event.get("usage") or usage
    return Streamed(rid, ttft, usage, (sent_ns, first_ns), tokens)


def prompts(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    prefix = [rng.randrange(3, 1000) for _ in range(n)]
    return prefix + [rng.randrange(3, 1000) for _ in range(SUFFIX)], prefix + [rng.randrange(3, 1000) for _ in
                                                                               range(SUFFIX)]


def cluster_rows(cluster, setup: str, sizes: list[int], trials: int, rng: random.Random) -> list[Row]:
    import ray

    from pdcluster.router.run_store import load_run

    def reset():
        for inst in cluster.instances:
            deadline = time.monotonic() + 120  # a lease may still pin blocks for a moment
            while not ray.get(inst.actor.reset_prefix_cache.remote()):
                assert time.monotonic() < deadline, f"{inst.name} would not reset its prefix cache"
                time.sleep(0.2)

    timed: dict[str, tuple[int, str, dict, tuple[int, int]]] = {}
    for n in sizes:
        for _ in range(trials):
            for cache in ("cold", "warm"):
                a, b = prompts(rng, n)
                reset()
                stream_ttft(cluster.url, a)
                if cache == "cold":
                    reset()
                rid, ttft, usage, client_ns, _ = stream_ttft(cluster.url, b)
                timed[rid] = (n, cache, {"ttft": ttft, **usage}, client_ns)
    time.sleep(0.5)  # the router appends each record as its request ends
    rows = []
    for rec in load_run(cluster.run_dir).records:
        if rec.request_id not in timed:
            continue
        n, cache, got, (sent_ns, first_ns) = timed[rec.request_id]
        ev = rec.events
        if rec.local_prefill:  # D alone: no P in it
            stamps = [sent_ns, ev["arrival"], ev["dispatch"], ev["d_queued"], ev["d_first_token"], ev["first_token"],
                      first_ns]
            parts = {name: (b - a) / 1e6 for name, a, b in zip(PARTS, stamps, stamps[1:])}
            rows.append(Row(n, setup, cache, got["ttft"], None, 0, rec.d_cached_tokens, local=True, parts=parts))
            continue
        rows.append(Row(n, setup, cache, got["ttft"], (ev["d_first_token"] - ev["p_done"]) / 1e6,
                        rec.p_cached_tokens, rec.d_cached_tokens))
        # P's engine alone, queued to its first token: what the seed timed on one device.
        rows.append(Row(n, f"{setup}: P engine", cache, (ev["p_done"] - ev["p_queued"]) / 1e6, None,
                        rec.p_cached_tokens, 0))
    return rows


def single_rows(reference, sizes: list[int], trials: int, rng: random.Random) -> list[Row]:
    import ray

    rows = []
    for n in sizes:
        for _ in range(trials):
            for cache in ("cold", "warm"):
                a, b = prompts(rng, n)
                ray.get(reference.reset_prefix_cache.remote())
                ray.get(reference.ttft.remote(a))
                if cache == "cold":
                    ray.get(reference.reset_prefix_cache.remote())
                ttft, parts = ray.get(reference.ttft_parts.remote(b))
                parts = {"to_engine_core": parts["submit_to_queued"] * 1e3, "engine": parts["queued_to_first"] * 1e3,
                         "to_router": parts["first_to_caller"] * 1e3}  # "to_router": back to its caller
                rows.append(Row(n, "single", cache, ttft * 1e3, None, 0, 0, parts=parts))
    return rows


def parts_table(rows: list[Row], sizes: list[int]) -> str:
    """Warm TTFT's parts, medians: D alone (local prefill) beside the single engine."""
    out = ["| prefix tokens | setup | " + " | ".join(PARTS) + " | TTFT |", "|---" * (len(PARTS) + 3) + "|"]
    for n in sizes:
        for setup in sorted({r.setup for r in rows if r.parts}, key=lambda s: (s == "single", s)):
            mine = [r for r in rows if (r.setup, r.tokens, r.cache) == (setup, n, "warm") and r.parts]
            if not mine:
                continue
            cells = [statistics.median([r.parts[p] for r in mine]) if p in mine[0].parts else None for p in PARTS]
            out.append(f"| {n:,} | {setup} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
                       + f" | {statistics.median([r.ttft_ms for r in mine]):.2f} |")
    return "\n".join(out)


def table(rows: list[Row], sizes: list[int]) -> str:
    def med(setup, n, cache, field):
        vals = [getattr(r, field) for r in rows if (r.setup, r.tokens, r.cache) == (setup, n, cache)]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    out = ["| prefix tokens | setup | cold TTFT ms | warm TTFT ms | speed-up | cold after-P ms | warm after-P ms |",
           "|---|---|---|---|---|---|---|"]
    for n in sizes:
        for setup in sorted({r.setup for r in rows}, key=lambda s: (s == "single", s)):
            cold, warm = med(setup, n, "cold", "ttft_ms"), med(setup, n, "warm", "ttft_ms")
            speed = f"{cold / warm:.2f}x" if cold and warm else "-"
            out.append(f"| {n:,} | {setup} | {fmt(cold)} | {fmt(warm)} | {speed} | "
                       f"{fmt(med(setup, n, 'cold', 'after_p_ms'))} | {fmt(med(setup, n, 'warm', 'after_p_ms'))} |")
    return "\n".join(out)


def local_prefill_fields(which: str, max_tokens: int | None) -> dict:
    from pdcluster.proto.router_spec import LocalPrefillSpec

    if which not in ("off", "on"):
        raise SystemExit(f"--local-prefill: 'off', 'on' or 'off,on', not {which!r}")
    spec = LocalPrefillSpec(policy="short_remainder" if which == "on" else "never")
    return spec.model_copy(update={"max_tokens": max_tokens} if max_tokens else {}).model_dump()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096,8192,16384")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny seed-0 Qwen3)")
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype")
    ap.add_argument("--connector", default="pdc", choices=["pdc", "nixl"], help="transfer.connector")
    ap.add_argument("--transports", default="grpc,torch_dist", help="pdc: the transports to run, each push and pull")
    ap.add_argument("--no-single", action="store_true", help="skip the single-engine rows")
    ap.add_argument("--sim", default=None, metavar="PARAMS",
                    help="simulated engines with this cost-model parameter file (e.g. qwen3-0.6b-1dev): "
                         "the seed's protocol against the sim; implies --no-single")
    ap.add_argument("--local-prefill", default="off", metavar="off,on",
                    help="router.local_prefill per pass: off (every prefill on P), on (short_remainder, "
                         "--local-max-tokens), or both for each setup")
    ap.add_argument("--local-max-tokens", type=int, default=None, help="router.local_prefill.max_tokens when on")
    ap.add_argument("--out", default=None, help="write every row as JSON")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    max_len = max(sizes) + 2 * SUFFIX + 128

    import ray

    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.cluster.reference_engine import ReferenceEngine
    from pdcluster.proto.names import NAMESPACE
    from pdcluster.proto.spec import parse_spec

    model = a.model or ".pdcluster/models/tiny-qwen3"
    engine = {"dtype": a.dtype, "max_model_len": max_len, "max_num_batched_tokens": max_len}
    spec = parse_spec({
        "name": "bench-pd-ttft", "model": {"path": model, "tiny": {"arch": "qwen3", "seed": 0}},
        "engine": {**engine, "kind": "sim"} if a.sim else engine,
        **({"sim": {"params": a.sim}} if a.sim else {}),
        "prefill": {"resources": {"cpu_bind": ["0"]}}, "decode": {"resources": {"cpu_bind": ["1"]}},
        "router": {"port": 18999}, "transfer": {"base_port": 18900, "connector": a.connector},
    }, base_dir=Path.cwd())
    if a.sim:
        a.no_single = True
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    cluster = build_cluster(spec)
    rng = random.Random(12345)
    rows: list[Row] = []
    try:
        stream_ttft(cluster.url, [rng.randrange(3, 1000) for _ in range(1000)])  # first connections, first passes
        setups = ([(m, t) for t in a.transports.split(",") for m in ("push", "pull")] if a.connector == "pdc"
                  else [("pull", "grpc")])
        for mode, transport in setups:
            for local in a.local_prefill.split(","):
                cluster.each_router("set_transfer_mode", mode, transport if a.connector == "pdc" else None)
                cluster.each_router("set_local_prefill", local_prefill_fields(local, a.local_max_tokens))
                name = (("sim " if a.sim else "") + f"{a.connector} {mode}"
                        + (f" {transport}" if a.connector == "pdc" else "") + (", local prefill" if local == "on" else ""))
                rows += cluster_rows(cluster, name, sizes, a.trials, rng)
                print(table(rows, sizes), "\n", flush=True)
    finally:
        teardown(cluster)
    if not a.no_single:
        reference = ray.remote(num_cpus=0)(ReferenceEngine).remote(spec.model.path, "0", max_len, a.dtype,
                                                                    enable_prefix_caching=True)
        ray.get(reference.ttft.remote([5, 6, 7] * 100))
        rows += single_rows(reference, sizes, a.trials, rng)
    ray.shutdown()
    print(table(rows, sizes))
    if any(r.parts for r in rows if r.setup != "single"):
        print("\nwarm TTFT's parts (ms, medians):\n" + parts_table(rows, sizes))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
