"""`pdc bench run`: build a workload, replay it phase by phase, summarize, write, join timelines.

`run_bench(BenchConfig)` is the one entry point (the CLI and the demo call it).
Phases run one after another, each drained before the next: warm-up (not
counted), seed (fills the prefix caches), cache-check (verifies each reported
`cached_tokens` against the workload's expectation), formal (the window the
figures are about). Against a pdcluster router, each request is joined with
its timeline record by request id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdcluster.cluster.replay import workloads
from pdcluster.cluster.replay.driver import DriveConfig, run_phase
from pdcluster.cluster.replay.goodput import DEFAULT_METRICS, DEFAULT_PERCENTILES, SloFigures, format_slo, slo_figures
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
    # vllm bench serve's result options (cluster/replay/goodput.py), on the formal window.
    percentile_metrics: tuple[str, ...] = DEFAULT_METRICS
    metric_percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput_ms: dict[str, float] | None = None  # KEY -> bound in ms

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
    slo: SloFigures | None = None  # --percentile-metrics / --metric-percentiles / --goodput, if asked


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
    slo = None
    if (cfg.goodput_ms or tuple(cfg.percentile_metrics) != DEFAULT_METRICS
            or tuple(cfg.metric_percentiles) != DEFAULT_PERCENTILES) and summaries:
        main = "formal" if "formal" in summaries else next(reversed(summaries))
        slo = slo_figures(results, main, summaries[main].benchmark_duration_s, cfg.percentile_metrics,
                          cfg.metric_percentiles, cfg.goodput_ms)
    timelines = {rec.request_id: rec for rec in load_run(run_dir).records} if run_dir else {}
    out = Path(cfg.out or Path(".pdcluster/bench") / f"{cfg.preset or 'bench'}-{time.strftime('%Y%m%d-%H%M%S')}")
    config = {**dataclasses.asdict(cfg), "vocab_size": vocab, "timeline_run_dir": run_dir,
              "hit_mismatches": mismatches}
    write_run(out, results, summaries.values(), config, timelines or None, slo)
    return BenchRun(cfg, results, summaries, mismatches, timelines, out, requests, slo)


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
    if run.slo is not None:
        parts.append(format_slo(run.slo))
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
