"""A chaos soak: a replay through a cluster while its instances are killed and its links cut.

Starts the spec's cluster (the simulated engine: its output is a pure function of each
request's context, so every stream can be checked token by token), replays a load (a preset,
shortened with --num-requests), and meanwhile kills a random P or D every --kill-every seconds
with ray.kill (Ray restarts it; one instance of each role is always left alive). With --lab N
the cluster runs in a multi-host lab of N hosts made for the soak (cluster/lab.py: P on the
first half of the hosts, D on the rest, the router here on the head), and every --cut-every
seconds the path between a random P's host and a random D's host is cut for --cut-for seconds
(dropped on the bridge: no FIN, no RST), then healed. Then it waits for every instance to be
back and every KV block to be free, and reports:

- requests sent, succeeded, migrated (moved off a lost D), retried (moved off a lost P), refused
  with a 429, failed with a clear error (an HTTP status or an error event naming the problem),
  and lost (no answer at all: a connection error, a timeout, an empty stream): must be 0;
- streams whose tokens are not exactly the undisturbed output (a token twice, missing or
  wrong): must be 0;
- KV blocks in use on each instance once idle: must be 0;
- timeline records written vs requests answered (a 429 writes none).

usage: python -m pdcluster.bench.chaos deploy/p8d8-sim.yaml --preset c90 [--num-requests 200]
                                       [--kill-every 20] [--seed 0] [--out FILE.json]
                                       [--lab 4 --cut-every 15 --cut-for 6]   (needs root)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.cluster.replay.records import RequestResult
from pdcluster.cluster.sim.request import CONTEXT_TOKENS, context_token


@dataclass(frozen=True)
class Kill:
    at_s: float  # since the replay started
    instance: str


@dataclass(frozen=True)
class Cut:
    at_s: float  # since the replay started
    hosts: tuple[str, str]  # the lab hosts cut from each other: a P's, a D's
    pairs: tuple[tuple[str, str], ...]  # every (P, D) it separated: each P on the one host, each D on the other
    start_ns: int  # time.monotonic_ns(): the router's clock too (the lab's hosts share this kernel)
    end_ns: int

    def caught(self, rec) -> bool:
        """Whether this cut fell into `rec`'s transfer (its P and D one of the pairs it separated)."""
        start = rec.events.get("transfer_start")
        end = rec.events.get("transfer_end", rec.events.get("finish"))
        return ((rec.prefill_instance, rec.decode_instance) in self.pairs and start is not None
                and end is not None and start < self.end_ns and end > self.start_ns)


@dataclass(frozen=True)
class ChaosPlan:
    kill_every_s: float | None = None  # None: no kills
    cut_every_s: float | None = None  # None: no cuts (they need a lab)
    cut_for_s: float = 6.0
    seed: int = 0


@dataclass
class ChaosReport:
    sent: int = 0
    succeeded: int = 0
    migrated: int = 0  # requests moved off a lost decode instance
    retried: int = 0  # requests moved off a lost prefill instance
    rejected: int = 0  # 429 (admission control)
    failed: int = 0  # ended with an error that names the problem
    lost: int = 0  # no answer at all
    wrong_streams: int = 0  # succeeded, but not exactly the undisturbed output
    kills: list[Kill] = field(default_factory=list)
    cuts: list[Cut] = field(default_factory=list)
    blocks_in_use: dict[str, float] = field(default_factory=dict)  # instance -> KV cache usage once idle
    cut_transfers: int = 0  # requests whose transfer a cut fell into
    records: int = 0  # timeline records of the answered requests
    answered: int = 0  # requests that got an HTTP answer other than 429
    errors: list[str] = field(default_factory=list)  # the failed and lost, first few

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.wrong_streams == 0 and not any(self.blocks_in_use.values())
                and self.records == self.answered)


def expected_output(prompt, n: int, vocab_size: int) -> list[int]:
    """What the simulated engine generates for `prompt`, undisturbed (cluster/sim/request.py):
    each token from the CONTEXT_TOKENS before it."""
    context, out = list(prompt[-CONTEXT_TOKENS:]), []
    for i in range(n):
        token = context_token(context, len(prompt) + i, vocab_size)
        out.append(token)
        context = context[1:] + [token] if len(context) == CONTEXT_TOKENS else context + [token]
    return out


def is_lost(r: RequestResult) -> bool:
    """No answer at all: neither an HTTP status nor an error event that says what went wrong."""
    return not r.ok and not (r.error.startswith("HTTP ") or r.error.startswith("stream error: "))


def _alive(cluster) -> dict[str, list] | None:
    """Each role's instances the router's /health reports up (None: no answer)."""
    import httpx

    try:
        up = httpx.get(f"{cluster.url}/health", timeout=5).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return {role: [i for i in insts if up.get(i.name)]
            for role, insts in (("prefill", cluster.prefill), ("decode", cluster.decode))}


def kill_loop(cluster, stop: threading.Event, every_s: float, rng: random.Random, t0: float,
              kills: list[Kill]) -> None:
    """Kill a random live instance every `every_s`, never the last live one of its role."""
    import ray

    while not stop.wait(every_s):
        alive = _alive(cluster)
        candidates = [i for insts in (alive or {}).values() if len(insts) > 1 for i in insts]
        if not candidates:
            continue
        victim = rng.choice(candidates)
        ray.kill(victim.actor, no_restart=False)  # Ray restarts it
        kills.append(Kill(time.monotonic() - t0, victim.name))


def cut_loop(cluster, lab, stop: threading.Event, every_s: float, for_s: float, rng: random.Random, t0: float,
             cuts: list[Cut]) -> None:
    """Every `every_s`, cut a random live P's host from a random live D's host for `for_s`, then heal
    (also when the soak ends mid-cut). Hosts are read from each instance's current node: Ray may
    have restarted it on another host its placement allows."""
    import ray

    host_at = {h.address: h.name for h in lab.hosts}
    while not stop.wait(every_s):
        alive = _alive(cluster)
        if not alive:
            continue
        try:
            where = {i.name: host_at.get(ray.get(i.actor.info.remote(), timeout=5).node_ip)
                     for insts in alive.values() for i in insts}
        except Exception:  # an instance went down meanwhile (a kill): next time
            continue
        pairs = [(p.name, d.name) for p in alive["prefill"] for d in alive["decode"]
                 if where[p.name] and where[d.name] and where[p.name] != where[d.name]]
        if not pairs:
            continue
        p, d = rng.choice(pairs)
        hosts = (where[p], where[d])
        separated = tuple((a, b) for a, b in pairs if (where[a], where[b]) == hosts)
        lab.partition(*hosts)
        at_s, start_ns = time.monotonic() - t0, time.monotonic_ns()
        try:
            stop.wait(for_s)
        finally:
            lab.heal(*hosts)
            cuts.append(Cut(at_s, hosts, separated, start_ns, time.monotonic_ns()))


def wait_idle(cluster, timeout_s: float) -> dict[str, float]:
    """Every instance back (the router's /health) and its KV cache empty; what each still holds."""
    import httpx
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    usage: dict[str, float] = {}
    while time.monotonic() < deadline:
        usage = {i.name: ray.get(i.actor.load.remote(), timeout=10).kv_cache_usage for i in cluster.instances}
        if not any(usage.values()):
            break
        time.sleep(1)  # a P's lease for a request whose D died ends by itself (transfer.lease_s)
    return usage


def soak(cluster, cfg, plan: ChaosPlan, lab=None, log=print) -> ChaosReport:
    """Replay `cfg` through `cluster` under `plan`'s kills and cuts (cuts need the `lab` the
    cluster runs in), then check what came back."""
    from pdcluster.cluster.replay.run import run_bench, server_info
    from pdcluster.router.run_store import load_run

    assert plan.cut_every_s is None or lab is not None, "link cuts need the lab the cluster runs in"
    vocab, run_dir = server_info(cfg.base_url)
    stop, kills, cuts = threading.Event(), [], []
    t0 = time.monotonic()
    # Each loop its own generator, so the kills are the same with and without cuts.
    loops = []
    if plan.kill_every_s is not None:
        loops.append((kill_loop, (cluster, stop, plan.kill_every_s, random.Random(plan.seed), t0, kills)))
    if plan.cut_every_s is not None:
        loops.append((cut_loop, (cluster, lab, stop, plan.cut_every_s, plan.cut_for_s,
                                 random.Random(plan.seed + 1), t0, cuts)))
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in loops]
    for t in threads:
        t.start()
    try:
        run = run_bench(cfg, log=log)
    finally:
        stop.set()
        for t in threads:
            t.join()
    usage = wait_idle(cluster, cluster.spec.transfer.lease_s + 120)
    results = run.results
    by_index = {r.index: r for r in results}
    prompts = {req.index: req.prompt_token_ids for req in run.requests}
    report = ChaosReport(sent=len(results), kills=kills, cuts=cuts, blocks_in_use=usage)
    records = {rec.request_id: rec for rec in load_run(run_dir).records} if run_dir else {}
    for r in results:
        if r.ok:
            report.succeeded += 1
            if r.token_ids != expected_output(prompts[r.index], r.output_tokens, vocab) or \
                    len(r.token_ids) != r.output_tokens:
                report.wrong_streams += 1
                report.errors.append(f"#{r.index} {r.request_id}: its tokens differ from the undisturbed output")
        elif r.rejected:
            report.rejected += 1
        elif is_lost(r):
            report.lost += 1
            report.errors.append(f"#{r.index} lost: {r.error}")
        else:
            report.failed += 1
            report.errors.append(f"#{r.index} {r.request_id}: {r.error}")
        rec = records.get(r.request_id) if r.request_id else None
        if rec is not None:
            roles = {m.role for m in rec.migrations}
            report.migrated += "decode" in roles
            report.retried += "prefill" in roles
    answered = [r for r in by_index.values() if not r.rejected and not is_lost(r)]
    report.cut_transfers = sum(1 for rec in records.values() if any(c.caught(rec) for c in cuts))
    report.answered = len(answered)
    report.records = sum(1 for r in answered if r.request_id in records)
    return report


def format_report(rep: ChaosReport) -> str:
    lines = [f"sent {rep.sent}: succeeded {rep.succeeded} (migrated {rep.migrated}, retried {rep.retried}), "
             f"refused with 429 {rep.rejected}, failed with an error {rep.failed}, lost {rep.lost}",
             f"kills: {len(rep.kills)} ({', '.join(f'{k.instance}@{k.at_s:.0f}s' for k in rep.kills[:12])}"
             f"{' ...' if len(rep.kills) > 12 else ''})",
             f"link cuts: {len(rep.cuts)} ({', '.join(f'{c.hosts[0]}|{c.hosts[1]}@{c.at_s:.0f}s' for c in rep.cuts[:8])}"
             f"{' ...' if len(rep.cuts) > 8 else ''}), {rep.cut_transfers} transfers caught in one",
             f"streams not exactly the undisturbed output: {rep.wrong_streams}",
             f"KV blocks in use once idle: {sum(1 for v in rep.blocks_in_use.values() if v)} instances "
             f"({', '.join(f'{k} {v:.1%}' for k, v in rep.blocks_in_use.items() if v) or 'none'})",
             f"records written: {rep.records} of {rep.answered} answered requests",
             "OK" if rep.ok else "NOT OK"]
    lines += [f"  {e}" for e in rep.errors[:10]]
    return "\n".join(lines)


LAB_NAME, LAB_SUBNET = "pdcchaos", "10.213.72.0/24"


def in_lab(spec, lab):
    """`spec` on `lab`'s Ray: P spread over the first half of its hosts, D over the rest, so every
    P's host and D's host is a pair a cut can separate; the routers stay on the head."""
    from pdcluster.proto.spec import PlacementSpec

    names = [h.name for h in lab.hosts]
    half = len(names) // 2
    assert half >= 1, f"a lab of {len(names)} hosts has no P hosts apart from D hosts: give it 2 or more"
    on = lambda hosts: PlacementSpec(labels={"pdc-host": f"in({','.join(hosts)})"}, spread=True)  # noqa: E731
    return spec.model_copy(update={
        "ray_address": lab.ray_address,
        "prefill": spec.prefill.model_copy(update={"placement": on(names[:half])}),
        "decode": spec.decode.model_copy(update={"placement": on(names[half:])}),
    })


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--preset", default="c90")
    ap.add_argument("--num-requests", type=int, default=None, help="the formal window's requests (default: the preset's)")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (0: none)")
    ap.add_argument("--lab", type=int, default=0, metavar="HOSTS",
                    help="run the cluster in a multi-host lab of this many hosts (needs root)")
    ap.add_argument("--cut-every", type=float, default=0.0, help="seconds between link cuts (needs --lab; 0: none)")
    ap.add_argument("--cut-for", type=float, default=6.0, help="how long each cut lasts, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report as JSON")
    a = ap.parse_args()
    if a.cut_every and not a.lab:
        ap.error("--cut-every: link cuts need --lab HOSTS (the hosts to cut apart)")

    import contextlib

    from pdcluster.cluster.lab import Lab
    from pdcluster.cluster.launch import running_cluster
    from pdcluster.cluster.replay.run import BenchConfig
    from pdcluster.proto.spec import load_spec

    spec = load_spec(a.spec)
    if spec.engine.kind != "sim":
        ap.error(f"{a.spec}: engine.kind is {spec.engine.kind!r}; the soak checks every stream against "
                 "the simulated engine's output (engine.kind: sim)")
    plan = ChaosPlan(kill_every_s=a.kill_every or None, cut_every_s=a.cut_every or None, cut_for_s=a.cut_for,
                     seed=a.seed)
    with Lab.up(hosts=a.lab, name=LAB_NAME, subnet=LAB_SUBNET) if a.lab else contextlib.nullcontext() as lab:
        with running_cluster(spec if lab is None else in_lab(spec, lab)) as cluster:
            cfg = BenchConfig.from_preset(a.preset, **({"num_requests": a.num_requests} if a.num_requests else {}))
            cfg = dataclasses.replace(cfg, base_url=cluster.url, progress=False,
                                      engine_block_size=spec.role_engine("prefill").block_size)
            rep = soak(cluster, cfg, plan, lab)
    print(format_report(rep))
    if a.out:
        Path(a.out).write_text(json.dumps(dataclasses.asdict(rep), indent=1))
    raise SystemExit(0 if rep.ok else 1)


if __name__ == "__main__":
    main()
