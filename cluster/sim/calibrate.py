"""Where the fitted numbers of the shipped parameter files come from, and the tables of docs/sim.md.

`fit_seed000()` solves qwen3-0.6b-1dev.yaml's overheads and efficiencies from seed 000's
table 8.2; `fit_h200(csv)` fits qwen3-0.6b-h200.yaml's to the H200 prefill csv. The tests
check that the shipped files hold what these fits give. `python -m
pdcluster.cluster.sim.calibrate` prints the calibration tables and the DeepSeek-V4
single-request predictions that docs/sim.md shows.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdcluster.cluster.sim.cost import CostModel, SimParams

PARAMS_DIR = Path(__file__).resolve().parent / "params"
# A copy of ../shared/data/calibration/h200_prefill_hf_sdpa.csv (measured on one H200, 2026-11-30;
# its README there), shipped so the fit and its tests run wherever the package does.
H200_CSV = Path(__file__).resolve().parent / "params" / "h200_prefill_hf_sdpa.csv"

# Seed 000 (../shared/seeds/000_0e96071f21115645.txt) section 8.2: shared prefix -> (cold, warm)
# TTFT medians, seconds; each prompt is the prefix + a 14-token suffix, batch 1, eager.
SEED000_TTFT_S = {1024: (0.03728, 0.03736), 4096: (0.04917, 0.03955), 8192: (0.11108, 0.04207),
                  16384: (0.31851, 0.04728)}
SEED000_SUFFIX = 14

# Seed 002's request (../shared/seeds/002_0650e35c1ffcc097.txt): prompt, cached prefix, output.
DSV4_PROMPT, DSV4_HIT, DSV4_OUTPUT = 131_076, 118_784, 1_024


def load(name: str) -> SimParams:
    return SimParams.load(PARAMS_DIR / f"{name}.yaml")


@dataclass(frozen=True)
class Seed000Fit:
    prefill_step_s: float
    prefill_kv_read: float
    gemm: float
    attention: float
    hidden_device_s: float


def fit_seed000(params: SimParams) -> Seed000Fit:
    """warm = overhead + context x per-token read (least squares over the four prefixes);
    cold - that = a L + b L^2 - hidden, solved exactly on 4K..16K (1K's device work hides)."""
    m, d = params.model, params.device
    (full,) = m.attention
    prompts = np.array([p + SEED000_SUFFIX for p in SEED000_TTFT_S], dtype=float)
    cold = np.array([c for c, _ in SEED000_TTFT_S.values()])
    warm = np.array([w for _, w in SEED000_TTFT_S.values()])
    (overhead, per_token), *_ = np.linalg.lstsq(np.vstack([np.ones(4), prompts]).T, warm, rcond=None)
    device = cold - overhead - per_token * prompts
    rows = prompts[1:]
    a, b, hidden = np.linalg.solve(np.vstack([rows, rows ** 2, -np.ones(3)]).T, device[1:])
    bytes_per_token = full.layers * full.bytes_per_key
    return Seed000Fit(
        prefill_step_s=float(overhead),
        prefill_kv_read=float(bytes_per_token / (d.hbm_bytes_per_s * per_token)),
        gemm=float(2 * m.body_params / (d.gemm_flops * a)),
        attention=float(full.flops_per_pair / 2 / (d.attention_flops * b)),
        hidden_device_s=float(hidden))


@dataclass(frozen=True)
class PrefillRow:
    model: str
    new: int
    history: int
    seconds: float


def h200_rows(path: Path = H200_CSV) -> list[PrefillRow]:
    with path.open() as f:
        return [PrefillRow(r["model"], int(r["tokens_new"]), int(r["tokens_history"]), float(r["seconds"]))
                for r in csv.DictReader(f)]


@dataclass(frozen=True)
class H200Fit:
    prefill_step_s: float
    gemm: float
    attention: float
    attention_history: float


def fit_h200(params: SimParams, rows: list[PrefillRow], min_tokens: int = 8192) -> H200Fit:
    """Least squares on relative error over the rows of at least min_tokens (below, HF's fixed
    overheads dominate): seconds = overhead + gemm FLOPs / rate + self / rate + history / rate."""
    m, d = params.model, params.device
    (full,) = m.attention
    used = [r for r in rows if r.new + r.history >= min_tokens]
    assert used, f"no csv row of {min_tokens}+ tokens to fit"
    x = np.array([[1.0, 2 * m.body_params * r.new, full.flops_per_pair * r.new * (r.new + 1) / 2,
                   full.flops_per_pair * r.new * r.history] for r in used])
    y = np.array([r.seconds for r in used])
    (overhead, per_gemm, per_self, per_history), *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    return H200Fit(float(overhead), float(1 / (per_gemm * d.gemm_flops)), float(1 / (per_self * d.attention_flops)),
                   float(1 / (per_history * d.attention_flops)))


def qwen3_8b_on(params: SimParams) -> SimParams:
    """The same device and efficiencies with Qwen3-8B's shape (HF config: 36 layers, 32 query heads,
    8 KV heads x 128, hidden 4096, intermediate 12288): to predict the csv's 8B rows."""
    m = params.model
    shape = m.model_copy(update={
        "layers": 36, "body_params": 6_946_075_648, "lm_head_params": 622_329_856,
        "weight_bytes_per_step": 2 * (6_946_075_648 + 2 * 622_329_856),
        "attention": (m.attention[0].model_copy(update={"layers": 36, "heads": 32}),),
        "components": (m.components[0].model_copy(update={"layers": 36}),)})
    return params.model_copy(update={"model": shape, "name": f"{params.name} (Qwen3-8B shape)"})


def seed000_ttft_s(cm: CostModel, prefix: int) -> tuple[float, float]:
    """(cold, warm) TTFT: one prefill step of the whole prompt, or of the suffix over the cached prefix."""
    return (cm.prefill_step_s([(prefix + SEED000_SUFFIX, 0)]),
            cm.prefill_step_s([(SEED000_SUFFIX, prefix)]))


def _pct(model: float, measured: float) -> str:
    return f"{100 * (model / measured - 1):+.1f}%"


def report(csv_path: Path = H200_CSV) -> str:
    lines = ["## seed 000: Qwen3-0.6B, one Ascend device (qwen3-0.6b-1dev)",
             "| prefix | seed cold ms | model | err | seed warm ms | model | err | seed ratio | model |",
             "|---|---|---|---|---|---|---|---|---|"]
    cm = CostModel(load("qwen3-0.6b-1dev"), 128)
    for prefix, (cold, warm) in SEED000_TTFT_S.items():
        mc, mw = seed000_ttft_s(cm, prefix)
        lines.append(f"| {prefix:,} | {cold * 1e3:.2f} | {mc * 1e3:.2f} | {_pct(mc, cold)} | {warm * 1e3:.2f} | "
                     f"{mw * 1e3:.2f} | {_pct(mw, warm)} | {cold / warm:.2f}x | {mc / mw:.2f}x |")
    lines.append(f"TPOT model: {cm.decode_step_s([1024 + SEED000_SUFFIX]) * 1e3:.1f} ms (seed ~33.2 ms)")
    lines.append(f"fit: {fit_seed000(load('qwen3-0.6b-1dev'))}")

    if csv_path.exists():
        h200 = load("qwen3-0.6b-h200")
        rows = h200_rows(csv_path)
        lines += ["", "## H200 HF SDPA prefill (qwen3-0.6b-h200; the 8B rows predicted, not fitted)",
                  "| model | tokens | cold s | model | err | warm s | model | err | cold/warm | model |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, params in (("qwen3-0.6b", h200), ("qwen3-8b", qwen3_8b_on(h200))):
            cm = CostModel(params, 128)
            mine = [r for r in rows if r.model == name]
            for cold, warm in zip(mine[::2], mine[1::2]):
                mc = cm.prefill_step_s([(cold.new, 0)])
                mw = cm.prefill_step_s([(warm.new, warm.history)])
                lines.append(f"| {name} | {cold.new // 1024}K | {cold.seconds:.4f} | {mc:.4f} | {_pct(mc, cold.seconds)} "
                             f"| {warm.seconds:.4f} | {mw:.4f} | {_pct(mw, warm.seconds)} | "
                             f"{cold.seconds / warm.seconds:.2f}x | {mc / mw:.2f}x |")
        lines.append(f"fit (0.6B rows): {fit_h200(h200, [r for r in rows if r.model == 'qwen3-0.6b'])}")
        lines.append(f"fit (8B rows, for comparison): {fit_h200(qwen3_8b_on(h200), [r for r in rows if r.model == 'qwen3-8b'])}")

    cm = CostModel(load("dsv4-flash-910c"), 128)
    new = DSV4_PROMPT - DSV4_HIT
    state = cm.state_bytes(DSV4_PROMPT)
    warm = cm.prefill_step_s([(new, DSV4_HIT)])
    decode_batch = round(90 / 8)
    per_token = cm.decode_step_s([DSV4_PROMPT + DSV4_OUTPUT // 2] * decode_batch)
    transfer = cm.transfer_s(sum(state.values()))
    lines += ["", "## dsv4-flash-910c: one request of seed 002's shape, on an idle instance",
              f"cold prefill, one step: {cm.prefill_step_s([(DSV4_PROMPT, 0)]):.2f} s; in 16K / 8K chunks: "
              f"{cm.prefill_s(DSV4_PROMPT, 0, 16384):.2f} / {cm.prefill_s(DSV4_PROMPT, 0, 8192):.2f} s",
              f"90%-warm prefill ({new:,} new over {DSV4_HIT:,}): {warm:.2f} s",
              f"state: {state} = {sum(state.values()):,} B; transfer {transfer * 1e3:.1f} ms",
              f"decode at batch {decode_batch}, context ~{DSV4_PROMPT + DSV4_OUTPUT // 2:,}: "
              f"{per_token * 1e3:.2f} ms per emitted token",
              f"alone: TTFT ~{warm + transfer:.2f} s, E2E ~{warm + transfer + (DSV4_OUTPUT - 1) * per_token:.1f} s "
              f"(seed 002 at C90: TTFT 12.68 s, TPOT 10.3 ms, E2E 23.24 s)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=H200_CSV, help="the H200 prefill csv")
    print(report(parser.parse_args().csv))


if __name__ == "__main__":
    main()
