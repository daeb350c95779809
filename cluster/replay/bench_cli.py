"""`pdc bench run|show|compare` and the load flags `pdc sim run` and `pdc plan` share: the
command line of a replay (cluster/replay/run.py runs it, saved.py reads it back). Every flag
is checked (`check_load`): a bad value is refused naming the flag, exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import httpx

from pdcluster.cluster.replay.goodput import parse_goodput, parse_metrics, parse_percentiles
from pdcluster.cluster.replay.presets import PRESETS
from pdcluster.cluster.replay.run import SYNTHETIC_REQUESTS, BenchConfig, report, run_bench


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
    o = r.add_argument_group("results, as vllm bench serve names them")
    o.add_argument("--percentile-metrics", type=_checked(parse_metrics),
                   help="metrics to print percentiles of: ttft, tpot, itl, e2el (default ttft,tpot,itl)")
    o.add_argument("--metric-percentiles", type=_checked(parse_percentiles),
                   help="those percentiles, comma-separated (default 99)")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="bounds in ms (ttft, tpot, e2el): the formal requests that met them all, and their rate "
                        "(default: none)")
    r.set_defaults(fn=_cmd_run)
    s = sub.add_parser("show", help="print a saved run's tables (a pdc bench run or pdc sim run --out directory)")
    s.add_argument("dir")
    s.add_argument("--phase", help="one phase's table (default: the formal window, the others in a line each)")
    s.set_defaults(fn=_cmd_show)
    c = sub.add_parser("compare", help="saved runs' formal windows side by side, each as a ratio to the first")
    c.add_argument("dirs", nargs="+", metavar="dir")
    c.set_defaults(fn=_cmd_compare)


def _checked(parse):
    """An argparse type from a parser raising ValueError: its message, as argparse's error."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    check.__name__ = parse.__name__
    return check


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
    if getattr(a, "goodput", None):
        given["goodput_ms"] = parse_goodput(a.goodput)
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
