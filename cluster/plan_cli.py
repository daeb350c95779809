"""`pdc plan PARAMS --devices N [load] --slo-ttft-ms MS --slo-tpot-ms MS [...]`: sweep P:D splits and
settings on the virtual clock and rank them for the SLO (cluster/sim/plan.py); prints what the answer
rests on (the parameter file and its basis, the base spec, the load) and the table, writes
OUT/plan.html and OUT/plan.json, and with --write-spec the chosen configuration as a cluster spec
`pdc up` takes (validated by proto/spec.py before it is written).

SLO bounds are in milliseconds, as vLLM's `--goodput ttft:MS tpot:MS` (accepted too), at any
percentile from 1 to 99 (--slo-percentile, default 90).

A bad argument, spec or parameter file is one line on stderr naming it, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "deploy" / "p8d8-sim.yaml"


def _fail(message: str) -> None:
    print(f"pdc plan: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _list(text: str | None, kind, flag: str) -> list | None:
    if text is None:
        return None
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        _fail(f"{flag} {text!r}: a comma-separated list of {kind.__name__} values")


GOODPUT_KEYS = ("ttft", "tpot")


def _bounds_ms(a: argparse.Namespace) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) bounds in ms from --slo-ttft-ms / --slo-tpot-ms and --goodput KEY:MS."""
    for old in ("ttft", "tpot"):
        if getattr(a, f"old_{old}") is not None:
            _fail(f"--slo-{old}-p90 (seconds) is gone: the bound is in milliseconds, --slo-{old}-ms MS (or "
                  f"--goodput {old}:MS), at --slo-percentile P (default 90)")
    from pdcluster.cluster.replay.goodput import parse_goodput

    bounds = {"ttft": a.slo_ttft_ms, "tpot": a.slo_tpot_ms}
    try:
        given = parse_goodput(a.goodput or [], GOODPUT_KEYS)
    except ValueError as err:
        _fail(str(err))
    for key, ms in given.items():
        if bounds[key] is not None:
            _fail(f"--goodput {key}:{ms:g}: the {key.upper()} bound is given twice (--slo-{key}-ms too)")
        bounds[key] = ms
    return bounds["ttft"], bounds["tpot"]


def _cmd_plan(a: argparse.Namespace) -> None:
    from tqdm import tqdm

    from pdcluster.cluster.replay.bench_cli import config_from_args, load_flags
    from pdcluster.cluster.sim.cost import SimParamsError
    from pdcluster.cluster.sim.plan import plan
    from pdcluster.cluster.sim.plan_rank import decided_by
    from pdcluster.cluster.sim.plan_report import (
        answer_details,
        format_table,
        provenance_lines,
        rerun_command,
        slo_text,
        twin_heading,
        twin_lines,
        write_outputs,
    )
    from pdcluster.cluster.sim.plan_types import Slo
    from pdcluster.proto.router_spec import POLICIES
    from pdcluster.proto.spec import SpecError, load_spec

    policies = _list(a.policies, str, "--policies")
    for p in policies or []:
        if p not in POLICIES:
            _fail(f"--policies: unknown policy {p!r}; one of {', '.join(POLICIES)}")
    grid = {k: v for k, v in {"splits": _list(a.splits, int, "--splits"), "budgets": _list(a.budgets, int, "--budgets"),
                              "max_seqs": _list(a.max_seqs, int, "--max-seqs"), "policies": policies,
                              "caps": _list(a.caps, int, "--caps"),
                              "local_prefill": _list(a.local_prefill, int, "--local-prefill"),
                              "tier_gib": _list(a.tier_gib, float, "--tier-gib")}.items() if v}
    workload = a.preset or (Path(a.trace).name if a.trace else "synthetic")
    bar = None
    try:
        ttft_ms, tpot_ms = _bounds_ms(a)
        slo = Slo(None if ttft_ms is None else ttft_ms / 1e3, None if tpot_ms is None else tpot_ms / 1e3,
                  a.slo_percentile, a.min_throughput)
        base = load_spec(a.target or a.spec)
        note = None
        if a.target and not (Path(base.model.path) / "config.json").exists():
            # The prompts' token ids need a tokenizer's vocabulary; the costs are the parameter file's.
            base = base.model_copy(update={"model": load_spec(DEFAULT_SPEC).model})
            note = (f"the target's checkpoint ({load_spec(a.target).model.path}) is not here: the model is the "
                    f"parameter file's, the prompts' token ids the tiny model's")
        cfg = config_from_args(a, progress=False)
        t0 = time.perf_counter()
        bar = tqdm(desc="configurations", unit="run", disable=None, leave=False, dynamic_ncols=True)

        def progress(done: int, total: int, outcome) -> None:
            bar.total = total
            bar.set_postfix_str(outcome.config.label, refresh=False)
            bar.update(1)

        shown_spec = (_shown(a.target) + " (the target)" if a.target else
                      "deploy/p8d8-sim.yaml (the default)" if a.spec == str(DEFAULT_SPEC) else a.spec)
        degrees = _list(a.devices_per_instance, int, "--devices-per-instance")
        result = plan(base, a.params, a.devices, cfg, slo, workload, grid or None, progress, base_spec=shown_spec,
                      note=note, degrees=degrees)
        twin = result.provenance.calibrated_twin if result.provenance and not a.no_twin else None
        if twin:  # issue 27 item 2: the model fitted to the users' measurements answers beside it
            bar.reset()
            bar.set_description(f"configurations ({twin})")
            result.twin = plan(base, twin, a.devices, cfg, slo, workload, grid or None, progress,
                               base_spec=shown_spec, note=note, degrees=degrees)
    except (SpecError, SimParamsError, ValueError, OSError) as err:
        _fail(str(err))
    finally:
        if bar is not None:
            bar.close()
    out = Path(a.out or f".pdcluster/plan/{workload}-{a.devices}dev-{time.strftime('%Y%m%d-%H%M%S')}")
    result.rerun_flags = load_flags(a)
    if result.twin is not None:
        result.twin.rerun_flags = result.rerun_flags
    print(f"{len(result.outcomes)} configurations of {a.devices} devices on {workload}, SLO {slo_text(result)}; "
          f"{time.perf_counter() - t0:.1f} s")
    print("\n".join(provenance_lines(result)))
    print(format_table(result))
    c = result.chosen
    print(f"chosen: {c.config.label} (SLO {'met' if c.slo_met else 'missed: no configuration meets it'}); "
          f"decided by {decided_by(result)}")
    if a.headroom != "none":
        _search_headroom(result, result.outcomes[:1] if a.headroom == "chosen" else result.outcomes)
    for _, label, text in answer_details(result):
        print(f"  {label.lower()}: {text}")
    if result.twin is not None:
        if a.headroom != "none":
            _search_headroom(result.twin, result.twin.outcomes[:1])
        print(twin_heading(result.twin))
        for line in twin_lines(result.twin):
            print(f"  {line}")
    page, doc = write_outputs(result, out)
    print(f"written: {page}, {doc}")
    print(f"re-run one with its timelines: {rerun_command(result, out, 1)}  (01: the chosen; configs/NN.yaml: "
          f"rank NN), then pdc timeline report {out / 'runs' / '01' / 'timeline'}")
    if a.write_spec:
        written = spec_choice(result)
        if written is not c:
            print(f"note: the best is no disaggregation ({c.config.label}), which a P/D spec cannot launch "
                  f"(serve each device with vllm serve); the spec written is the best split, rank "
                  f"{result.outcomes.index(written) + 1}: {written.config.label}")
        if a.target:
            write_target_spec(Path(a.target), written.config, Path(a.write_spec), result)
        else:
            write_spec(base, a.params, written.config, Path(a.write_spec), result)


def spec_choice(result):
    """The outcome --write-spec writes: the chosen one, or the best with P if the chosen has none
    (pdc up launches P/D clusters; no disaggregation is the virtual clock's baseline)."""
    return next((o for o in result.outcomes if not o.config.colocated), result.chosen)


def _search_headroom(result, outcomes) -> None:
    """plan_headroom's search for each of `outcomes`, with progress on the terminal."""
    from tqdm import tqdm

    from pdcluster.cluster.sim.plan_headroom import headroom

    with tqdm(desc="headroom", unit="run", disable=None, leave=False, dynamic_ncols=True) as bar:
        for o in outcomes:
            def step(m: float, ok: bool, label=o.config.label) -> None:
                bar.set_postfix_str(f"{label}: {m:.2f}x {'holds' if ok else 'misses'}", refresh=False)
                bar.update(1)
            result.headrooms[o.config] = headroom(result, o, on_run=step)


def _shown(path: str) -> str:
    """A spec's path for what pdc plan writes: a shipped one as deploy/NAME, another by its name
    (no path of this machine in a spec made for another)."""
    p = Path(path).resolve()
    return f"deploy/{p.name}" if p.parent == DEFAULT_SPEC.parent else p.name


def write_target_spec(target: Path, config, path: Path, result) -> None:
    """The target spec as its file says it, with the chosen split and settings and nothing else
    changed (its paths are the target hardware's): the role counts, the engine's chunked-prefill
    budget and running requests (a role's own value of either removed: it would override), the
    router's policy, admission cap and local prefill; validated as pdc up reads it, then written."""
    import yaml

    from pdcluster.cluster.sim.plan_report import provenance_lines, slo_text
    from pdcluster.proto.spec import SpecError, parse_spec, read_yaml

    data = read_yaml(target, ValueError)
    for role, n in (("prefill", config.prefill), ("decode", config.decode)):
        section = data.setdefault(role, {})
        section["instances"] = n
        for key in ("max_num_batched_tokens", "max_num_seqs"):
            (section.get("engine") or {}).pop(key, None)
        lists = {f"{role}.resources.cpu_bind": (section.get("resources") or {}).get("cpu_bind"),
                 f"{role}.placement.per_instance": (section.get("placement") or {}).get("per_instance")}
        for name, value in lists.items():
            if isinstance(value, list) and len(value) != n:
                _fail(f"--target {target}: {name} lists {len(value)} instances, the chosen split {n}: "
                      f"give it {n} or drop it")
    data.setdefault("engine", {}).update(max_num_batched_tokens=config.max_num_batched_tokens,
                                         max_num_seqs=config.max_num_seqs)
    router = data.setdefault("router", {})
    router["policy"] = config.policy
    if config.max_in_flight is not None:
        router.setdefault("admission", {})["max_in_flight"] = config.max_in_flight
    if config.host_tier_gib is not None:  # the host tier as swept (0: none)
        data["engine"]["host_tier_gib"] = config.host_tier_gib
        for role in ("prefill", "decode"):
            (data[role].get("engine") or {}).pop("host_tier_gib", None)
    if config.local_prefill is not None:  # conditional disaggregation as swept (0: never)
        local = router.setdefault("local_prefill", {})
        local["policy"] = "short_remainder" if config.local_prefill else "never"
        if config.local_prefill:
            local["max_tokens"] = config.local_prefill
    try:
        parse_spec(data, str(path))
    except SpecError as err:
        _fail(f"the chosen configuration does not make a valid spec from {target}: {err}")
    head = (f"# Written by pdc plan from {_shown(str(target))}: {config.label}, chosen for {result.workload} on "
            f"{result.devices} devices, SLO {slo_text(result)}\n" + "".join(f"# {line}\n" for line in
                                                                         provenance_lines(result)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + yaml.safe_dump(data, sort_keys=False))
    print(f"spec: {path} (pdc up {path} on the target's hardware)")


def write_spec(base, params: str | None, config, path: Path, result) -> None:
    """The chosen configuration as a spec: the base spec's, with its split and settings (a simulated
    spec with the plan's parameter file); validated as `pdc up` would, then written."""
    import yaml

    from pdcluster.cluster.sim.plan import configure
    from pdcluster.cluster.sim.plan_report import slo_text
    from pdcluster.cluster.sim.virtual.run import as_sim_spec
    from pdcluster.proto.spec import SpecError, parse_spec

    kept = as_sim_spec(base, params) if base.sim is not None or base.engine.kind == "sim" else base
    chosen = configure(kept, config)
    data = chosen.model_dump(mode="json", exclude_defaults=True, exclude={"auth"})
    try:
        parse_spec(data, str(path))
    except SpecError as err:
        _fail(f"the chosen configuration does not make a valid spec: {err}")
    from pdcluster.cluster.sim.plan_report import provenance_lines

    head = (f"# Written by pdc plan: {config.label}, chosen for {result.workload} on {result.devices} devices, "
            f"SLO {slo_text(result)}\n" + "".join(f"# {line}\n" for line in provenance_lines(result)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + yaml.safe_dump(data, sort_keys=False))
    print(f"spec: {path} (pdc up {path})")


def add_plan_command(subparsers) -> None:
    from pdcluster.cluster.replay.bench_cli import add_load_arguments

    p = subparsers.add_parser("plan", help="pick a P:D split and settings for an SLO on the virtual clock")
    p.add_argument("params", help="cost-model parameter file (a shipped name, a path, or a pdc sim fit output)")
    p.add_argument("--devices", type=int, required=True, help="devices to split between P and D")
    p.add_argument("--devices-per-instance", default="1",
                   help="tensor parallel degrees to sweep, e.g. 1,2,4 (each one the parameter file's parallel "
                        "section prices; default 1: one device per instance)")
    p.add_argument("--spec", default=str(DEFAULT_SPEC), help="the base cluster spec (default deploy/p8d8-sim.yaml)")
    add_load_arguments(p)
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-ms", type=float, help="TTFT bound, milliseconds")
    s.add_argument("--slo-tpot-ms", type=float, help="TPOT bound, milliseconds")
    s.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="the bounds as vLLM's bench takes them: ttft:MS tpot:MS")
    s.add_argument("--slo-percentile", type=int, default=90,
                   help="the share of all requests sent (a refused one a miss) the bounds hold for, 1-99")
    for old in ("ttft", "tpot"):  # the seconds flags before issue 27: refused with a pointer to the ms ones
        s.add_argument(f"--slo-{old}-p90", f"--slo-{old}", dest=f"old_{old}", help=argparse.SUPPRESS)
    s.add_argument("--min-throughput", type=float, help="formal requests per second the cluster must complete")
    g = p.add_argument_group("sweep (default: every split, then one setting at a time around the best)")
    g.add_argument("--splits", help="P counts to try, e.g. 4,6,8")
    g.add_argument("--budgets", help="max_num_batched_tokens values, e.g. 8192,16384")
    g.add_argument("--max-seqs", help="max_num_seqs values")
    g.add_argument("--policies", help="router policies, e.g. prefix_aware,least_load")
    g.add_argument("--caps", help="router admission caps (requests in flight)")
    g.add_argument("--local-prefill", help="D prefills remainders of at most this many tokens itself "
                                           "(router.local_prefill short_remainder; 0: never), e.g. 0,2048,8192")
    g.add_argument("--tier-gib", help="host KV tier sizes per instance to try, GiB (0: none), e.g. 0,16,64: on the "
                                      "best configuration (crossed with the other lists if any are given)")
    p.add_argument("--out", help="output directory (default .pdcluster/plan/<workload>-<N>dev-<time>)")
    p.add_argument("--target", help="a spec for real engines (e.g. deploy/p8d8-npu.yaml): plan on its simulated twin "
                                    "instead of --spec, and --write-spec writes it with the chosen split and settings")
    p.add_argument("--write-spec", help="write the chosen configuration as a cluster spec here")
    p.add_argument("--no-twin", action="store_true",
                   help="skip the same sweep on the parameter file's calibrated twin (its about.calibrated_twin)")
    p.add_argument("--headroom", choices=("chosen", "all", "none"), default="chosen",
                   help="search the highest load at which the chosen configuration (or each) still meets the SLO")
    p.set_defaults(fn=_cmd_plan)
