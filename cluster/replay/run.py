"""`pdc bench run`: build a workload, replay it phase by phase, summarize, write, join timelines.

`run_bench(BenchConfig)` is the one entry point (the CLI and the demo call it).
Phases run one after another, each drained before the next: warm-up (not
counted), seed (fills the prefix caches), cache-check (verifies each reported
`cached_tokens` against the workload's expectation), formal (the window the
figures are about). Against a pdcluster router, each request is joined with
its timeline record by request id.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdcluster.cluster.replay import workloads
from pdcluster.cluster.replay.driver import DriveConfig, run_phase
from pdcluster.cluster.replay.metrics import PhaseSummary, summarize_phases
from pdcluster.cluster.replay.outputs import format_phase_breakdown, format_summary, write_run
from pdcluster.cluster.replay.presets import PRESETS
from pdcluster.cluster.replay.records import BenchRequest, RequestResult
from pdcluster.proto.load_phases import PHASES
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline import RequestRecord

PHASE_ORDER = PHASES  # proto/load_phases.py: the replay names each request after its phase


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    # synthetic workload (a preset fills these)
    input_len: int = 4100
    shared_prefix_ratio: float = 3712 / 4100
    output_len: int = 32
    num_prefixes: int = 4
    seed_phase: bool = True
    # or a Mooncake trace
    trace: str | None = None
    trace_block_size: int = 512
    time_scale: float = 1.0
    closed_loop: bool = False  # trace: ignore its timestamps
    # load shape
    num_requests: int | None = None  # None: the whole trace, or SYNTHETIC_REQUESTS of a synthetic load
    max_concurrency: int | None = 8  # None: no cap (a trace on its timestamps, by default: config_from_args)
    request_rate: float | None = None  # requests/s cap; None: closed loop only
    burstiness: float = 1.0
    duration_s: float | None = None
    warmup: int = 0
    # the rest
    engine_block_size: int = 128
    vocab_size: int | None = None  # default: the server's /v1/models `vocab_size`
    seed: int = 0
    timeout_s: float = 600.0
    retries_after_429: int = 0  # resend a request refused with 429 after its Retry-After, this many times
    out: str | None = None
    # The router's API key, if it asks for one (router auth.api_keys): --api-key or PDC_API_KEY.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    progress: bool = True
    preset: str | None = None

    @classmethod
    def from_preset(cls, name: str, **overrides) -> BenchConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        p = PRESETS[name]
        base = dict(input_len=p.input_len, shared_prefix_ratio=p.shared_prefix_ratio, output_len=p.output_len,
                    num_prefixes=p.num_prefixes, seed_phase=p.seed_phase, num_requests=p.num_requests,
                    max_concurrency=p.max_concurrency, request_rate=p.request_rate, burstiness=p.burstiness,
                    warmup=p.warmup, preset=name)
        return cls(**{**base, **overrides})


SYNTHETIC_REQUESTS = 40  # a synthetic load's size unless --num-requests says otherwise


@dataclass
class BenchRun:
    config: BenchConfig
    results: list[RequestResult]
    summaries: dict[str, PhaseSummary]
    hit_mismatches: list[str]  # the cache-check (and formal) requests whose hit was not the expected one
    timelines: dict[str, RequestRecord]
    out_dir: Path
    requests: list[BenchRequest] = dataclasses.field(default_factory=list)  # what was sent, by index


def server_info(base_url: str, api_key: str | None = None) -> tuple[int | None, str | None]:
    """(vocab size the server declares, the pdcluster router's run dir) — None where not offered."""
    vocab = run_dir = None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    models = httpx.get(f"{base_url}/v1/models", timeout=10, headers=headers)
    models.raise_for_status()
    data = models.json().get("data") or [{}]
    vocab = data[0].get("vocab_size") or _tokenizer_vocab(data[0].get("root"))
    r = httpx.get(f"{base_url}/pdc/run", timeout=10, headers=headers)
    if r.status_code == 200:
        run_dir = r.json().get("run_dir")
    return vocab, run_dir


def _tokenizer_vocab(root: str | None) -> int | None:
    """A plain vLLM server names no vocab size, but its model's path (`root`): the tokenizer's
    size there, if this machine has it (a local path, or a hub id in the local cache)."""
    if not root:
        return None
    try:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(root, local_files_only=True))
    except Exception:  # not on this machine: the caller asks for --vocab-size
        return None


def build_workload(cfg: BenchConfig, vocab_size: int) -> list[BenchRequest]:
    if cfg.trace:
        reqs = workloads.load_mooncake(cfg.trace, cfg.trace_block_size, cfg.engine_block_size, vocab_size=vocab_size,
                                       seed=cfg.seed, limit=cfg.num_requests, time_scale=cfg.time_scale)
    else:
        formal = workloads.synthetic_shared_prefix(
            cfg.num_requests or SYNTHETIC_REQUESTS, cfg.input_len, cfg.shared_prefix_ratio, cfg.output_len,
            cfg.num_prefixes,
            cfg.engine_block_size, vocab_size=vocab_size, seed=cfg.seed, seeded=cfg.seed_phase)
        if cfg.seed_phase:
            prefixes = workloads.family_prefixes(cfg.num_prefixes, cfg.input_len, cfg.shared_prefix_ratio,
                                                 vocab_size=vocab_size, seed=cfg.seed)
            reqs = workloads.seed_protocol(formal, prefixes, block_size=cfg.engine_block_size,
                                           vocab_size=vocab_size, seed=cfg.seed)
        else:
            reqs = formal
    if cfg.warmup:
        # Short prompts of their own seed: they share nothing with the workload.
        warm = workloads.synthetic_shared_prefix(cfg.warmup, min(256, cfg.input_len), 0.0, min(8, cfg.output_len), 1,
                                                 cfg.engine_block_size, vocab_size=vocab_size, seed=cfg.seed + 10_007)
        reqs = [dataclasses.replace(r, phase="warmup", expected_cached_tokens=None) for r in warm] + reqs
    return reqs


def run_bench(cfg: BenchConfig, log=print) -> BenchRun:
    vocab, run_dir = server_info(cfg.base_url, cfg.api_key)
    vocab = cfg.vocab_size or vocab
    if vocab is None:
        raise ValueError(f"{cfg.base_url} does not say its vocab size, and its model's tokenizer is not on this "
                         f"machine: pass --vocab-size")
    requests = build_workload(cfg, vocab)
    drive = DriveConfig(base_url=cfg.base_url, model=cfg.model, max_concurrency=cfg.max_concurrency,
                        request_rate=cfg.request_rate, burstiness=cfg.burstiness, duration_s=cfg.duration_s,
                        follow_timestamps=bool(cfg.trace) and not cfg.closed_loop, timeout_s=cfg.timeout_s,
                        seed=cfg.seed, progress=cfg.progress, api_key=cfg.api_key,
                        retries_after_429=cfg.retries_after_429)
    results: list[RequestResult] = []
    by_index = {r.index: r for r in requests}
    for phase in PHASE_ORDER:
        batch = [r for r in requests if r.phase == phase]
        if not batch:
            continue
        t0 = time.monotonic()
        # Seed and check phases fill and probe the cache: sent one family at a time, no rate cap.
        phase_drive = drive if phase in ("formal", "warmup") else dataclasses.replace(
            drive, request_rate=None, duration_s=None, follow_timestamps=False)
        phase_results = asyncio.run(run_phase(batch, phase_drive, phase))
        failed = sum(not r.ok for r in phase_results)
        log(f"phase {phase}: {len(phase_results)} requests in {time.monotonic() - t0:.1f} s, {failed} failed")
        results += phase_results
    results = expected_after_failures(results, by_index, cfg.engine_block_size)
    mismatches = workloads.check_hits(
        (by_index[r.index], r.cached_tokens) for r in results if r.ok and r.phase in ("check", "formal"))
    summaries = summarize_phases(results, cfg.max_concurrency)
    timelines = {rec.request_id: rec for rec in load_run(run_dir).records} if run_dir else {}
    out = Path(cfg.out or Path(".pdcluster/bench") / f"{cfg.preset or 'bench'}-{time.strftime('%Y%m%d-%H%M%S')}")
    config = {**dataclasses.asdict(cfg), "vocab_size": vocab, "timeline_run_dir": run_dir,
              "hit_mismatches": mismatches}
    write_run(out, results, summaries.values(), config, timelines or None)
    return BenchRun(cfg, results, summaries, mismatches, timelines, out, requests)


def expected_after_failures(results: list[RequestResult], by_index: dict[int, BenchRequest],
                            block_size: int) -> list[RequestResult]:
    """The workload's expected hits assume every earlier request left its blocks in the cache;
    a failed one did not. If any failed, each result's expected hit is worked out again, in the
    order they were sent, from the requests that succeeded (the ones without an expectation keep
    none)."""
    if all(r.ok for r in results):
        return results
    sent = sorted(results, key=lambda r: r.start_s)
    hits = workloads.prefix_hits_from_tokens((by_index[r.index].prompt_token_ids for r in sent), block_size,
                                             stored=(r.ok for r in sent))
    again = {r.index: hit for r, hit in zip(sent, hits)}
    fixed = [r if r.expected_cached_tokens is None else dataclasses.replace(r, expected_cached_tokens=again[r.index])
             for r in results]
    for r in fixed:  # check_hits reads the requests' expectations
        if r.expected_cached_tokens is not None:
            by_index[r.index] = dataclasses.replace(by_index[r.index], expected_cached_tokens=r.expected_cached_tokens)
    return fixed


def report(run: BenchRun) -> str:
    """The formal window (or the last phase), its cache check, and the per-phase attribution beside it."""
    parts = []
    for phase, summary in run.summaries.items():
        if phase in ("seed", "check"):
            parts.append(f"{phase} phase: {summary.success_requests}/{summary.total_requests} ok in "
                         f"{summary.benchmark_duration_s or 0:.1f} s")
    main = run.summaries.get("formal") or next(reversed(run.summaries.values()), None)
    if main is not None:
        parts.append(format_summary(main))
    parts.append("cache check: " + ("every reported cached_tokens matched the expectation" if not run.hit_mismatches
                                    else f"{len(run.hit_mismatches)} mismatches:\n  " + "\n  ".join(
                                        run.hit_mismatches[:10])))
    joined = [run.timelines[r.request_id] for r in run.results
              if r.phase == "formal" and r.request_id in run.timelines]
    if joined:
        parts.append(f"where the formal window's TTFT went (server side, {len(joined)} requests joined):")
        parts.append(format_phase_breakdown(joined))
    parts.append(f"written to {run.out_dir}/ (summary.json, summary.csv, requests.jsonl)")
    return "\n".join(parts)


def add_bench_commands(subparsers) -> None:
    """`pdc bench run|show|compare ...` on an existing `pdc` parser."""
    bench = subparsers.add_parser("bench", help="replay loads against an OpenAI-compatible endpoint")
    sub = bench.add_subparsers(dest="bench_cmd", required=True)
    r = sub.add_parser("run", help="run a workload (a preset, a synthetic shared-prefix load, or a Mooncake trace)")
    r.add_argument("--base-url", default=BenchConfig.base_url, help="server root, without /v1 (default %(default)s)")
    r.add_argument("--model", default=None, help="the model name sent (default: the server's)")
    add_load_arguments(r)
    r.add_argument("--timeout", dest="timeout_s", type=float, help=f"per request, s (default {BenchConfig.timeout_s:g})")
    r.add_argument("--retries-after-429", type=int, help="resend a request refused with 429 after its "
                                                         "Retry-After, at most this many times (default 0)")
    r.add_argument("--out", "--result-dir", help="output directory (default .pdcluster/bench/<preset>-<time>)")
    r.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    r.add_argument("--api-key", default=os.environ.get("PDC_API_KEY"),
                   help="the router's API key (default: $PDC_API_KEY), sent as a Bearer token")
    r.set_defaults(fn=_cmd_run)
    s = sub.add_parser("show", help="print a saved run's tables (a pdc bench run or pdc sim run --out directory)")
    s.add_argument("dir")
    s.add_argument("--phase", help="one phase's table (default: the formal window, the others in a line each)")
    s.set_defaults(fn=_cmd_show)
    c = sub.add_parser("compare", help="saved runs' formal windows side by side, each as a ratio to the first")
    c.add_argument("dirs", nargs="+", metavar="dir")
    c.set_defaults(fn=_cmd_compare)


def _defaults(field: str) -> str:
    return f"default {getattr(BenchConfig, field)}, or a preset's"


def add_load_arguments(r) -> None:
    """The workload and load shape (a preset, synthetic or a trace): `pdc bench run`'s, and the
    virtual clock's commands' (`pdc sim run`, `pdc plan`). `vllm bench serve`'s names work too
    where they mean the same (--num-prompts, --random-input-len, --random-output-len,
    --dataset-path for a Mooncake trace, --result-dir)."""
    r.add_argument("--preset", choices=sorted(PRESETS), default=None, help="c90 (production) or c90-tiny (this machine)")
    w = r.add_argument_group("synthetic workload")
    w.add_argument("--input-len", "--random-input-len", type=int, help=f"prompt tokens ({_defaults('input_len')})")
    w.add_argument("--shared-prefix-ratio", type=float, help="share of each prompt its prefix family shares "
                                                             f"(default {BenchConfig.shared_prefix_ratio:.4f}, or a preset's)")
    w.add_argument("--output-len", "--random-output-len", type=int, help=f"output tokens ({_defaults('output_len')})")
    w.add_argument("--num-prefixes", type=int, help=f"prefix families ({_defaults('num_prefixes')})")
    w.add_argument("--seed-phase", action=argparse.BooleanOptionalAction, default=None,
                   help="seed and cache-check phases before the formal window (default on)")
    t = r.add_argument_group("trace workload")
    t.add_argument("--trace", "--dataset-path", help="Mooncake-format JSONL (timestamp, input_length, "
                                                     "output_length, hash_ids)")
    t.add_argument("--trace-block-size", type=int, help=f"tokens per hash id ({_defaults('trace_block_size')})")
    t.add_argument("--time-scale", type=float, help="multiply trace timestamps (0.5: twice as fast; default 1)")
    t.add_argument("--closed-loop", action="store_true", default=None, help="ignore the trace's timestamps")
    ld = r.add_argument_group("load")
    ld.add_argument("--num-requests", "--num-prompts", type=int,
                    help=f"formal requests (default: the whole trace, {SYNTHETIC_REQUESTS} of a synthetic load, or "
                         f"a preset's)")
    ld.add_argument("--max-concurrency", type=int,
                    help="requests in flight at most (default: 8, a preset's own, or no cap for a trace on its "
                         "timestamps)")
    ld.add_argument("--request-rate", type=float, help="cap in requests/s (default: none, unless a preset sets one)")
    ld.add_argument("--burstiness", type=float, help="1: Poisson arrivals, 0: fixed spacing, else gamma (default 1)")
    ld.add_argument("--duration", dest="duration_s", type=float, help="stop sending after this many seconds "
                                                                      "(default: when the requests are sent)")
    ld.add_argument("--warmup", type=int, help="warm-up requests, not counted (default 0)")
    r.add_argument("--vocab-size", type=int, help="token ids drawn below it (default: the server's vocabulary)")
    r.add_argument("--engine-block-size", type=int, help=f"the engines' KV block, for the expected hits "
                                                         f"(default {BenchConfig.engine_block_size})")
    r.add_argument("--seed", type=int, help="the load's random seed (default 0)")


def load_flags(a) -> list[str]:
    """The add_load_arguments flags that parsed into `a`, as a command line again (`pdc plan` shows
    the `pdc sim run` that re-runs one of its configurations)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_load_arguments(parser)
    out: list[str] = []
    for action in parser._actions:
        value = getattr(a, action.dest, None)
        if value is None or not action.option_strings:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            out += [action.option_strings[0]] if value else []
        else:
            out += [action.option_strings[0], str(value)]
    return out


def config_from_args(a, **overrides) -> BenchConfig:
    """The BenchConfig the parsed arguments (add_load_arguments' and the command's own) name,
    checked (check_load: ValueError naming the flag). A trace replayed on its timestamps has no
    cap on requests in flight unless --max-concurrency gives one, as `vllm bench serve` sends."""
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    given = {k: v for k, v in vars(a).items() if k in fields and v is not None and k != "preset"}
    given.update(overrides)
    if given.get("trace") and not given.get("closed_loop") and "max_concurrency" not in given:
        given["max_concurrency"] = None
    if a.preset and given.get("trace"):
        raise ValueError(f"--preset {a.preset} and --trace: a preset is a synthetic load; give one or the other")
    cfg = BenchConfig.from_preset(a.preset, **given) if a.preset else BenchConfig(**given)
    check_load(cfg)
    return cfg


def check_load(cfg: BenchConfig) -> None:
    """ValueError naming the flag of the first value that makes no load."""
    checks = [("--input-len", cfg.input_len, cfg.input_len >= 1), ("--output-len", cfg.output_len, cfg.output_len >= 1),
              ("--num-prefixes", cfg.num_prefixes, cfg.num_prefixes >= 1),
              ("--shared-prefix-ratio", cfg.shared_prefix_ratio, 0 <= cfg.shared_prefix_ratio < 1),
              ("--num-requests", cfg.num_requests, cfg.num_requests is None or cfg.num_requests >= 1),
              ("--max-concurrency", cfg.max_concurrency, cfg.max_concurrency is None or cfg.max_concurrency >= 1),
              ("--request-rate", cfg.request_rate, cfg.request_rate is None or cfg.request_rate > 0),
              ("--burstiness", cfg.burstiness, cfg.burstiness >= 0),
              ("--time-scale", cfg.time_scale, cfg.time_scale > 0),
              ("--duration", cfg.duration_s, cfg.duration_s is None or cfg.duration_s > 0),
              ("--warmup", cfg.warmup, cfg.warmup >= 0), ("--trace-block-size", cfg.trace_block_size,
                                                          cfg.trace_block_size >= 1),
              ("--engine-block-size", cfg.engine_block_size, cfg.engine_block_size >= 1)]
    for flag, value, ok in checks:
        if not ok:
            what = "between 0 and 1 (below 1)" if flag == "--shared-prefix-ratio" else (
                "0 or more" if flag in ("--burstiness", "--warmup") else "above 0")
            raise ValueError(f"{flag} {value}: must be {what}")
    if cfg.trace and not Path(cfg.trace).is_file():
        raise ValueError(f"--trace {cfg.trace}: no such file")


def _cmd_show(a) -> None:
    from pdcluster.cluster.replay.saved import load_saved, show

    _print_or_fail(lambda: show(load_saved(a.dir), a.phase))


def _cmd_compare(a) -> None:
    from pdcluster.cluster.replay.saved import compare, load_saved

    def make() -> str:
        if len(a.dirs) < 2:
            raise ValueError(f"compare: two result directories or more (got {len(a.dirs)})")
        return compare([load_saved(d) for d in a.dirs])
    _print_or_fail(make)


def _print_or_fail(make) -> None:
    import sys

    try:
        print(make())
    except ValueError as err:
        print(f"pdc bench: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _cmd_run(a) -> None:
    import sys

    try:
        cfg = config_from_args(a)
        run = run_bench(cfg, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, OSError, httpx.HTTPError) as err:
        print(f"pdc bench: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(report(run))
