"""What `pdc plan` weighs (cluster/sim/plan.py sweeps, plan_rank.py ranks): an SLO, a
configuration of the cluster, the outcome of one run of it, and the plan they make."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.plan_anatomy import Anatomy
from pdcluster.cluster.sim.plan_provenance import Provenance
from pdcluster.proto.spec import ClusterSpec

MISS = math.inf  # a refused or failed request's TTFT and TPOT: it missed any bound
# Bounds outside these are taken for a unit mistake (seconds given as ms, or the reverse), not an SLO.
PLAUSIBLE_TTFT_MS, PLAUSIBLE_TPOT_MS = (1.0, 600_000.0), (0.1, 2_000.0)


def pname(q: int) -> str:
    return f"p{q}"


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    percentile: int = 90  # 1..99: the bounds hold for this share of all requests sent
    min_throughput: float | None = None  # formal requests/s over the whole cluster

    def __post_init__(self):
        if not 1 <= self.percentile <= 99:
            raise ValueError(f"--slo-percentile {self.percentile}: a percentile from 1 to 99")
        if self.ttft_s is None and self.tpot_s is None and self.min_throughput is None:
            raise ValueError("no SLO: give --slo-ttft-ms, --slo-tpot-ms (or --goodput ttft:MS tpot:MS) "
                             "and/or --min-throughput")
        for name, v, (lo, hi) in (("TTFT", self.ttft_s, PLAUSIBLE_TTFT_MS), ("TPOT", self.tpot_s, PLAUSIBLE_TPOT_MS)):
            if v is not None and not lo <= v * 1e3 <= hi:
                ms = v * 1e3
                raise ValueError(f"a {name} bound of {f'{ms:,.0f}' if ms >= 100 else f'{ms:g}'} ms is implausible "
                                 f"({lo:g} to {hi:,.0f} ms): "
                                 f"the SLO flags take milliseconds (--slo-{name.lower()}-ms, --goodput "
                                 f"{name.lower()}:MS)")
        if self.min_throughput is not None and not self.min_throughput > 0:
            raise ValueError(f"--min-throughput {self.min_throughput:g}: requests per second, above 0")


@dataclass(frozen=True)
class Config:
    prefill: int
    decode: int
    max_num_batched_tokens: int
    max_num_seqs: int
    policy: str
    max_in_flight: int | None  # the router's admission cap; None: the spec's
    # Conditional disaggregation: D prefills a request itself when at most this many of its prompt
    # tokens are not in D's cache (router.local_prefill short_remainder); 0: never; None: the spec's.
    local_prefill: int | None = None
    devices_per_instance: int = 1  # tensor parallel degree: every instance, P and D, runs on this many
    host_tier_gib: float | None = None  # each instance's host KV tier (0: none); None: the spec's

    @property
    def devices(self) -> int:
        return (self.prefill + self.decode) * self.devices_per_instance

    @property
    def split(self) -> str:
        """"P:D", and " xT" with T devices per instance."""
        return f"{self.prefill}:{self.decode}" + (f" x{self.devices_per_instance}" if self.devices_per_instance > 1 else "")

    @property
    def colocated(self) -> bool:
        """No P: every instance prefills and decodes (no disaggregation, the baseline)."""
        return self.prefill == 0

    @property
    def label(self) -> str:
        cap = f", cap {self.max_in_flight}" if self.max_in_flight else ""
        local = (", no disaggregation" if self.colocated else "" if self.local_prefill is None else
                 ", D never prefills" if self.local_prefill == 0 else f", D prefills <= {self.local_prefill}")
        tp = f" x{self.devices_per_instance} devices" if self.devices_per_instance > 1 else ""
        tier = ("" if self.host_tier_gib is None else f", host tier {self.host_tier_gib:g} GiB" if self.host_tier_gib
                else ", no host tier")
        return (f"P{self.prefill}D{self.decode}{tp}, budget {self.max_num_batched_tokens}, "
                f"seqs {self.max_num_seqs}, {self.policy}{cap}{local}{tier}")


@dataclass(frozen=True)
class Outcome:
    config: Config
    ttft_s: float | None  # at the SLO's percentile
    tpot_s: float | None
    e2e_mean_s: float | None
    throughput: float  # successful formal requests per second
    goodput_per_device: float  # formal requests meeting the latency SLO, per second, per device
    slo_met: bool
    failed: int  # formal requests refused (429) or failed
    hit_ratio: float | None
    virtual_s: float
    wall_s: float
    anatomy: Anatomy | None = None  # where its time goes, what binds it (plan_anatomy.py)

    @property
    def measured(self) -> bool:
        """Both percentiles known and on served requests (neither None nor MISS): a point to plot."""
        return self.ttft_s is not None and self.tpot_s is not None and MISS not in (self.ttft_s, self.tpot_s)


@dataclass
class Plan:
    slo: Slo
    devices: int
    workload: str
    outcomes: list[Outcome] = field(default_factory=list)  # ranked, best first
    provenance: Provenance | None = None  # None: a plan made by hand (tests)
    sim_base: ClusterSpec | None = None  # the base spec as simulated: each configuration is configure(sim_base, c)
    rerun_flags: list[str] = field(default_factory=list)  # the load's flags, for `pdc sim run` (plan_report)
    cfg: BenchConfig | None = None  # the load (plan_headroom scales it)
    vocab: int | None = None  # the prompts' vocabulary
    headrooms: dict = field(default_factory=dict)  # Config -> plan_headroom.Headroom, for those searched
    twin: Plan | None = None  # the same sweep on the parameter file's calibrated twin (Provenance.calibrated_twin)

    @property
    def chosen(self) -> Outcome:
        return self.outcomes[0]
