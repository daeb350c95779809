"""The README's main job: bring up a cluster, send a few requests, replay a load, stop.

One request is sent twice, so the second shows P's prefix-cache hit and that D
already held the prefix (nothing transferred but the tail). Then the scaled C90
load (cluster/replay/presets.py `c90-tiny`) replays through the router, and its AISBench
summary is printed beside the per-phase attribution of its TTFT.
"""

from __future__ import annotations

import time

from pdcluster.proto.spec import ClusterSpec

DOC = ("Prefill and decode are the two phases of serving a large language model. A prefix cache remembers "
       "the KV cache of prompts it has seen, so a repeated document is computed once. ") * 12


def _show(label: str, text: str, usage) -> None:
    pd = (usage.model_extra or {}).get("pd", {})
    details = usage.prompt_tokens_details
    print(f"--- {label}")
    print(f"    answer: {text!r}")
    print(f"    usage: prompt {usage.prompt_tokens}, completion {usage.completion_tokens}, "
          f"cached on P {details.cached_tokens if details else 0}, cached on D {pd.get('d_cached_tokens')}, "
          f"transferred {pd.get('transferred_tokens')}")


def run_demo(spec: ClusterSpec, replay: str | None = "c90-tiny") -> None:
    import openai
    import ray

    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.proto.names import NAMESPACE

    ray.init(address=spec.ray_address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             **({} if spec.ray_address else {"num_cpus": 2}))
    t0 = time.monotonic()
    print(f"starting {spec.name}: P{spec.prefill.instances} D{spec.decode.instances}, model {spec.model.path}")
    cluster = build_cluster(spec)
    try:
        print(f"up in {time.monotonic() - t0:.0f} s; endpoint {cluster.url}/v1")
        keys = cluster.spec.auth.api_keys  # the router asks for one of them, if any (auth.api_keys, PDC_API_KEYS)
        api_key = keys[0].get_secret_value() if keys else None
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=api_key or "none")
        model = spec.model.served_name
        for label in ("long document, first time", "same document again (prefix hit on P and D)"):
            r = client.completions.create(model=model, prompt=DOC + "Question: what does the cache save?",
                                          max_tokens=24, temperature=0)
            _show(label, r.choices[0].text, r.usage)
        chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                              messages=[{"role": "user", "content": "What is a prefix cache?"}])
        _show("chat", chat.choices[0].message.content, chat.usage)
        print("--- streaming: ", end="", flush=True)
        for chunk in client.completions.create(model=model, prompt="Decode is limited by", max_tokens=16,
                                               temperature=0, stream=True):
            if chunk.choices:
                print(chunk.choices[0].text, end="", flush=True)
        print("\n(the model has random weights: the words are noise, the mechanics are real)")
        if replay:
            from pdcluster.cluster.replay.run import BenchConfig, report, run_bench

            print(f"\n--- replaying the scaled C90 load ({replay}) through the router")
            print(report(run_bench(BenchConfig.from_preset(replay, base_url=cluster.url, api_key=api_key))))
    finally:
        teardown(cluster)
        ray.shutdown()
        print("cluster stopped")
    if cluster.run_dir:
        print(f"every request's timeline: pdc timeline summary|report {cluster.run_dir}")
