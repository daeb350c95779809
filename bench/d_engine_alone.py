"""D's own engine, alone on the machine: is a cluster's slower warm step the engine or its neighbours?

Builds one vLLM engine in this process with exactly the engine args and env a P1D1 cluster
gives its decode instance (cluster/engine_actor.py `plan_instance`: our connector as
kv_consumer, KV events on, D's core), and runs the first seed's warm protocol on it (reset,
A, time B; bench/pd_ttft.py), reporting vLLM's own parts of B's TTFT. `--without` drops the
connector or the KV events, to see what each costs. No Ray, no P, no router: what is left of
pd_ttft's "engine" part beside these figures is the cluster's other processes on the cores.

usage: python -m pdcluster.bench.d_engine_alone [--sizes 1024,16384] [--trials 5] [--dtype float32]
                                                [--without connector,events]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

SUFFIX = 14


async def warm_parts(llm, sizes: list[int], trials: int, rng: random.Random) -> None:
    from pdcluster.transfer.vllm_compat import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False)

    async def run(prompt: list[int]) -> tuple[float, float, float]:
        t0, ttft = time.monotonic(), None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=f"b-{time.monotonic_ns()}"):
            if ttft is None and out.outputs[0].token_ids:
                ttft, m = time.monotonic() - t0, out.metrics
        return ttft * 1e3, (m.queued_ts - t0) * 1e3, (m.first_token_ts - m.queued_ts) * 1e3

    await run([5, 6, 7] * 100)
    print("| prefix tokens | TTFT ms | submit to queued | queued to first token |\n|---|---|---|---|")
    for n in sizes:
        rows = []
        for _ in range(trials):
            prefix = [rng.randrange(3, 1000) for _ in range(n)]
            a, b = (prefix + [rng.randrange(3, 1000) for _ in range(SUFFIX)] for _ in range(2))
            assert await llm.reset_prefix_cache(), "reset_prefix_cache refused: a request still running?"
            await run(a)
            rows.append(await run(b))
        ttft, queued, engine = (statistics.median(col) for col in zip(*rows))
        print(f"| {n:,} | {ttft:.2f} | {queued:.2f} | {engine:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,16384")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--without", default="", help="comma-separated: connector, events")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    without = {w for w in a.without.split(",") if w}
    assert without <= {"connector", "events"}, f"--without: connector and/or events, not {a.without!r}"

    from pdcluster.cluster.instance_plan import plan_instance
    from pdcluster.proto.spec import parse_spec
    from pdcluster.transfer.auth import SECRET_ENV, generate_secret

    max_len = max(sizes) + 2 * SUFFIX + 128
    secret = generate_secret()
    spec = parse_spec({  # bench/pd_ttft.py's cluster
        "name": "bench-d-alone", "model": {"path": ".pdcluster/models/tiny-qwen3", "tiny": {"arch": "qwen3", "seed": 0}},
        "engine": {"dtype": a.dtype, "max_model_len": max_len, "max_num_batched_tokens": max_len},
        "prefill": {"resources": {"cpu_bind": ["0"]}}, "decode": {"resources": {"cpu_bind": ["1"]}},
        "router": {"port": 18999}, "transfer": {"base_port": 18900}, "auth": {"secret": secret},
    }, base_dir=Path.cwd())
    plan = plan_instance(spec, "decode", 0)
    os.environ.update(plan.env)
    os.environ[SECRET_ENV] = secret

    from pdcluster.transfer.vllm_compat import AsyncEngineArgs, AsyncLLM, KVEventsConfig, KVTransferConfig

    args = dict(plan.engine_args)
    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
    for name, key in (("connector", "kv_transfer_config"), ("events", "kv_events_config")):
        if name in without:
            del args[key]
    print(f"D's engine alone, without: {sorted(without) or 'nothing'}")
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    try:
        asyncio.run(warm_parts(llm, sizes, a.trials, random.Random(0)))
    finally:
        llm.shutdown()


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this module
    main()
