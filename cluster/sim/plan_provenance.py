"""What a plan's answer rests on (issue 27 item 1): the parameter file and where its numbers come
from (sim_params.About: sourced or fitted, how far its predictions were from real engines, what
was never checked), the base spec and the load. `pdc plan` names it in each of its outputs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.sim_params import ErrorBand


@dataclass(frozen=True)
class Provenance:
    """What a plan's answer rests on, named in each of its outputs (issue 27 item 1): the
    parameter file and where its numbers come from, the base spec, the load."""

    params: str  # the parameter file's name
    params_file: str  # a shipped file by its place in the package, another as given
    basis: str  # "sourced" | "fitted" | "unstated" (sim_params.About)
    summary: str
    fitted_to: str | None
    base_spec: str  # as given
    workload: str  # the load's name and shape
    note: str | None = None  # what else the answer rests on (a target's checkpoint not here)
    error: ErrorBand | None = None  # the file's predictions against real engines (None: never compared)
    unchecked: str | None = None  # what the file says was never checked against real hardware
    calibrated_twin: str | None = None  # a file of the same deployment fitted to the users' measurements
    steps_vary: str = ""  # how its step times vary around the model's (params `variation`), in words

    @classmethod
    def of(cls, params_path: str, base_spec: str, workload: str, note: str | None = None) -> Provenance:
        from pdcluster.cluster.sim.cost import SimParams
        from pdcluster.proto.spec import SHIPPED_SIM_PARAMS

        p = SimParams.load(params_path)
        v = p.variation
        vary = (f"steps vary as measured: D {v.decode_sd:.2f} each + {v.drift_sd:.2f} over {v.drift_steps} steps, "
                f"prefill {v.prefill_sd:.2f} (log spread)" if v.decode_sd or v.drift_sd or v.prefill_sd else
                "steps vary: not at all (no spread measured for this file): TPOT and ITL percentiles show batch "
                "and context effects only, narrower than a real engine's")
        path = Path(params_path)
        shown = (f"cluster/sim/params/{path.name}" if path.resolve().parent == SHIPPED_SIM_PARAMS.resolve()
                 else params_path)
        if p.about is None:
            return cls(p.name, shown, "unstated", "the file does not say where its numbers come from", None,
                       base_spec, workload, note, steps_vary=vary)
        a = p.about
        return cls(p.name, shown, a.basis, " ".join(a.summary.split()), a.fitted_to, base_spec, workload, note,
                   a.error, " ".join(a.unchecked.split()) if a.unchecked else None, a.calibrated_twin, vary)

    def lines(self) -> list[str]:
        """The provenance as text, a fact a line."""
        model = f"{self.params} ({self.params_file}), {self.basis}"
        if self.fitted_to:
            model += f" to {self.fitted_to}"
        e = self.error
        checked = (f"checked: {' '.join(e.source.split())}: predicted vs real TTFT {_band(e.ttft)}, TPOT "
                   f"{_band(e.tpot)}, E2E {_band(e.e2e)}" if e else "checked: never against real engines")
        return [f"model: {model}", f"  {self.summary}", checked,
                *([f"unchecked: {self.unchecked}"] if self.unchecked else []), *([self.steps_vary] if self.steps_vary else []),
                f"base spec: {self.base_spec}", f"load: {self.workload}", *([f"note: {self.note}"] if self.note else [])]


def _band(b: tuple[float, float]) -> str:
    def pct(x: float) -> str:
        return f"{x:+.1%}" if abs(x) < 0.01 else f"{x:+.0%}"
    return pct(b[0]) if b[0] == b[1] else f"{pct(b[0])} to {pct(b[1])}"


def describe_load(name: str, cfg: BenchConfig) -> str:
    """The load in a line: its name, then what it sends."""
    if cfg.trace:
        shape = f"trace {Path(cfg.trace).name}" + (", closed loop" if cfg.closed_loop else
                                                   f", its arrivals x{1 / cfg.time_scale:g}" if cfg.time_scale != 1
                                                   else ", its own arrivals")
    else:
        shape = (f"{cfg.input_len:,}-token prompts, {cfg.shared_prefix_ratio:.0%} shared over {cfg.num_prefixes} "
                 f"prefixes, {cfg.output_len:,} output tokens")
    rate = ("" if cfg.trace and not cfg.closed_loop else f", {cfg.request_rate:g} req/s" if cfg.request_rate
            else ", closed loop")
    count = f"{cfg.num_requests} requests" if cfg.num_requests else "every request"
    cap = f"at most {cfg.max_concurrency} in flight" if cfg.max_concurrency else "no cap on requests in flight"
    return f"{name}: {shape}; {cap}{rate}, {count}, seed {cfg.seed}"
