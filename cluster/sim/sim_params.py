"""A cost-model parameter file (params/*.yaml): a model's shape, a device, a link, overheads and
efficiencies, each number commented with its source. `SimParams.load(path)` reads and validates
one; every problem raises `SimParamsError` naming the file and the field. The model that answers
with them is cluster/sim/cost.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdcluster.proto.spec import read_yaml

ComponentKind = Literal["full", "window", "compressed", "state"]


class SimParamsError(ValueError):
    """An invalid parameter file; the message names the file and the field."""


@dataclass(frozen=True)
class Component:
    """One kind of per-request state, as vLLM's KV cache groups are."""

    name: str  # "full_kv", "swa_kv", "c4_kv", "c4_indexer", "c128_kv", ... (from the params file)
    kind: ComponentKind
    bytes_per_block: int  # one block of `block_size` tokens, summed over its layers (state: the one slot)
    window_tokens: int = 0  # window: only the last window_tokens are kept and moved
    compress_ratio: int = 1  # compressed: one entry per compress_ratio tokens (bytes_per_block accounts for it)


# ---- the parameter file ------------------------------------------------------------------------


class _Strict(BaseModel):
    # Unknown fields are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class AttentionTerm(_Strict):
    """One kind of attention over the context, in `layers` layers.

    A query at context length t (itself and every token before it) sees
    keys(t) entries: min(t, window) with a window; t // compress_ratio
    compressed entries, at most topk of them when top-k sparse; t otherwise.
    Each (query, key) pair costs 4 x heads x head_dim FLOPs (QK^T and PV), or
    2 x heads x head_dim for scores only (an indexer); each key read costs
    bytes_per_key.
    """

    name: str
    layers: int = Field(gt=0)
    heads: int = Field(gt=0, description="query heads")
    head_dim: int = Field(gt=0)
    window: int = Field(0, ge=0, description="keys: the last `window` tokens (0: no window)")
    compress_ratio: int = Field(1, ge=1, description="keys: one entry per compress_ratio tokens")
    topk: int = Field(0, ge=0, description="keys: at most topk selected entries (0: all)")
    scores_only: bool = Field(False, description="QK^T only (an indexer's scores), no PV")
    bytes_per_key: int = Field(gt=0, description="bytes of one key entry (K and V) in one layer")

    @model_validator(mode="after")
    def _one_shape(self) -> AttentionTerm:
        if self.window and (self.compress_ratio > 1 or self.topk):
            raise ValueError(f"attention term {self.name!r}: a window term has no compress_ratio or topk "
                             f"(list a window and a compressed term separately)")
        return self

    @property
    def flops_per_pair(self) -> int:
        return (2 if self.scores_only else 4) * self.heads * self.head_dim * self.layers


class ComponentSpec(_Strict):
    """One component of a request's state, as the parameter file gives it (sizes per entry, not per block)."""

    name: str
    kind: ComponentKind
    layers: int = Field(gt=0)
    bytes_per_entry: int = Field(gt=0, description="one token's (compressed: one entry's) bytes in one layer; "
                                                    "state: the slot's bytes in one layer")
    window_tokens: int = Field(0, ge=0)
    compress_ratio: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _kind_fields(self) -> ComponentSpec:
        if (self.kind == "window") != (self.window_tokens > 0):
            raise ValueError(f"component {self.name!r}: window_tokens must be set for kind window, and only then")
        if (self.kind == "compressed") != (self.compress_ratio > 1):
            raise ValueError(f"component {self.name!r}: compress_ratio > 1 for kind compressed, and only then")
        return self


class ModelShape(_Strict):
    layers: int = Field(gt=0)
    body_params: float = Field(gt=0, description="weights one token goes through, LM head and embeddings excluded")
    lm_head_params: float = Field(ge=0, description="the LM head, run once per sampled position")
    weight_bytes_per_step: float = Field(gt=0, description="weight bytes one instance reads per decode step")
    attention: tuple[AttentionTerm, ...] = Field(min_length=1)
    components: tuple[ComponentSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> ModelShape:
        for what, items in (("attention", self.attention), ("components", self.components)):
            names = [i.name for i in items]
            if len(set(names)) != len(names):
                raise ValueError(f"{what}: names repeat ({', '.join(names)})")
        return self


class DeviceSpec(_Strict):
    name: str
    gemm_flops: float = Field(gt=0, description="peak FLOP/s of the weights' matmuls (their dtype)")
    attention_flops: float = Field(gt=0, description="peak FLOP/s of attention (bf16)")
    hbm_bytes_per_s: float = Field(gt=0)
    kv_cache_bytes: float = Field(gt=0, description="device memory left for the KV cache")


class Efficiency(_Strict):
    gemm: float = Field(gt=0, le=1, description="fraction of gemm_flops the weights' matmuls reach")
    attention: float = Field(gt=0, le=1, description="fraction of attention_flops: new tokens over themselves")
    attention_history: float = Field(gt=0, le=1, description="fraction of attention_flops: new tokens over history")
    prefill_kv_read: float = Field(gt=0, le=1, description="fraction of HBM bandwidth: a prefill's context KV read")
    memory_bandwidth: float = Field(gt=0, le=1, description="fraction of HBM bandwidth: the weights every step "
                                                             "reads, and the KV of decoding requests")


class Overheads(_Strict):
    prefill_step_s: float = Field(ge=0, description="fixed time of a step with prefill chunks")
    decode_step_s: float = Field(ge=0, description="fixed time of a decode-only step (one iteration)")
    decode_request_s: float = Field(0, ge=0, description="host time per decode-shaped request per step (its "
                                                         "scheduling, inputs, sampling and output), on top of "
                                                         "the step's fixed time")
    hidden_device_s: float = Field(0, ge=0, description="device work that runs while the host launches ops "
                                                        "(eager mode), hidden inside the fixed time")


class Speculative(_Strict):
    draft_tokens: int = Field(ge=1, description="tokens proposed per request per iteration")
    accept_length: float = Field(ge=1, description="tokens emitted per request per iteration, on average")
    draft_s: float = Field(0, ge=0, description="the draft model's time per iteration")

    @model_validator(mode="after")
    def _accept_fits(self) -> Speculative:
        if self.accept_length > self.draft_tokens + 1:
            raise ValueError(f"accept_length ({self.accept_length}) > draft_tokens + 1 ({self.draft_tokens + 1})")
        return self


class DecodeSpec(_Strict):
    speculative: Speculative | None = None


class Variation(_Strict):
    """How a step's time varies around the model's on one instance (cluster/sim/variation.py): what
    real engines' steps do from host jitter, contention and what the model leaves out. Spreads are
    standard deviations of the time's logarithm (0.1: about +-10%); the time's mean is the model's.
    `pdc sim fit` measures them on a run's D steps; all 0: every step exactly the model's."""

    decode_sd: float = Field(0, ge=0, le=2, description="each decode step's own, independent of the next")
    drift_sd: float = Field(0, ge=0, le=2, description="shared by drift_steps consecutive steps: slow phases, "
                                                        "whole requests running slower or faster")
    drift_steps: int = Field(1, ge=1, description="steps one drift value lasts")
    prefill_sd: float = Field(0, ge=0, le=2, description="each step with prompt chunks, independent")
    seed: int = Field(0, ge=0, description="with the instance's name, the draws' key")


class Parallel(_Strict):
    """How one instance's times scale with its devices (tensor parallel degree t: every layer's
    weights and query heads split t ways, two all-reduces of the layer's hidden states per layer).
    A file without it models one device per instance; with it, `pdc plan --devices-per-instance`
    and `sim.devices_per_instance` may ask for any degree listed in `efficiency`. The `link` section
    is one device's port: t devices move KV over t of them."""

    efficiency: dict[int, float] = Field(description="degree -> the share of a t-fold speed-up the matmuls and "
                                                     "attention keep on t devices (1: perfect); degree 1 must be 1.0")
    collective_bytes_per_s: float = Field(gt=0, description="an all-reduce's bus bandwidth per device")
    collective_latency_s: float = Field(ge=0, description="one all-reduce's fixed time")
    collectives_per_layer: int = Field(2, ge=0, description="all-reduces per layer per step")
    hidden_bytes: int = Field(gt=0, description="one token's hidden state in one all-reduce, bytes")
    kv_sharded: bool = Field(description="each device holds 1/t of the KV (KV heads >= t); false: every device "
                                         "holds all of it (one KV head, MQA/MLA), so t devices hold no more requests")
    weight_memory_bytes: float = Field(ge=0, description="the weights' device memory at degree 1: t devices free "
                                                          "(1 - 1/t) of it per device for KV")

    @field_validator("efficiency")
    @classmethod
    def _degrees(cls, efficiency: dict[int, float]) -> dict[int, float]:
        if efficiency.get(1) != 1.0:
            raise ValueError("degree 1 must be listed, as 1.0 (the file's other numbers are its)")
        for t, e in efficiency.items():
            if t < 1 or not 0 < e <= 1:
                raise ValueError(f"degree {t} -> {e}; degrees from 1, each a share in (0, 1]")
        return efficiency


class LinkSpec(_Strict):
    bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class ErrorBand(_Strict):
    """How far a file's predictions were from real engines, as (predicted - real) / real, the
    lowest and the highest seen per metric (means), and where: `pdc plan` turns it into the range
    the real figure would fall in if the prediction errs as it did there."""

    source: str = Field(min_length=1, description="what was compared, where and when")
    ttft: tuple[float, float]
    tpot: tuple[float, float]
    e2e: tuple[float, float]

    @model_validator(mode="after")
    def _ordered(self) -> ErrorBand:
        for name in ("ttft", "tpot", "e2e"):
            lo, hi = getattr(self, name)
            if not -1 < lo <= hi:
                raise ValueError(f"{name}: [lowest, highest] relative errors, each above -1 (got [{lo}, {hi}])")
        return self

    def real_range(self, metric: str, predicted: float) -> tuple[float, float]:
        """The real value if the prediction errs as it did: predicted / (1 + error), over the band."""
        lo, hi = getattr(self, metric)
        return predicted / (1 + hi), predicted / (1 + lo)


class About(_Strict):
    """Where a file's numbers come from, in a line or two: `pdc plan` names it beside every
    answer (its table, page, JSON and written spec), so that no answer hides its model."""

    basis: Literal["sourced", "fitted"] = Field(
        description="sourced: every number from a datasheet, a config or an earlier fit, none from a run of "
                    "this model on this device; fitted: some numbers fitted to a run (fitted_to)")
    summary: str = Field(min_length=1, description="what the file models, and how far it can be trusted")
    fitted_to: str | None = Field(None, min_length=1, description="fitted: the run or figures it reproduces")
    error: ErrorBand | None = Field(None, description="its predictions against real engines (None: never compared)")
    unchecked: str | None = Field(None, min_length=1, description="what has never been checked against real hardware")
    calibrated_twin: str | None = Field(None, min_length=1, description="a shipped file of the same deployment fitted "
                                                                          "to the users' measurements: pdc plan answers "
                                                                          "with both")

    @model_validator(mode="after")
    def _a_fit_names_its_run(self) -> About:
        if (self.basis == "fitted") != (self.fitted_to is not None):
            raise ValueError("fitted_to: a fitted file names what it was fitted to; a sourced one has none")
        return self


class SimParams(_Strict):
    """One parameter file, loaded and validated."""

    name: str
    about: About | None = None  # None: the file does not say (an old `pdc sim fit` output)
    model: ModelShape
    device: DeviceSpec
    efficiency: Efficiency
    overheads: Overheads
    decode: DecodeSpec = DecodeSpec()
    variation: Variation = Variation()
    parallel: Parallel | None = None  # None: one device per instance
    link: LinkSpec
    # Host memory <-> one device (PCIe, HCCS): what a host KV tier's loads take (cluster/sim/tier.py);
    # None: the file prices no host tier.
    host_link: LinkSpec | None = None

    @property
    def degrees(self) -> list[int]:
        """The devices per instance the file prices (its `parallel` section's degrees; else 1)."""
        return sorted(self.parallel.efficiency) if self.parallel else [1]

    def check_degree(self, devices: int) -> None:
        """SimParamsError unless the file states how times scale to `devices` per instance."""
        if devices not in self.degrees:
            how = (f"its parallel section prices {', '.join(map(str, self.degrees))}" if self.parallel else
                   "it has no parallel section: one device per instance")
            raise SimParamsError(f"{self.name}: {devices} devices per instance: {how}")

    @classmethod
    def load(cls, path: str | Path) -> SimParams:
        path = Path(path)
        return cls.parse(read_yaml(path, SimParamsError), str(path))

    @classmethod
    def parse(cls, data: object, source: str = "<params>") -> SimParams:
        if not isinstance(data, dict):
            raise SimParamsError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            lines = [f"{source}: invalid sim parameters"]
            for e in err.errors():
                where = ".".join(str(part) for part in e["loc"])
                msg = e["msg"].removeprefix("Value error, ")
                lines.append(f"  {where}: {msg}" if where else f"  {msg}")
            raise SimParamsError("\n".join(lines)) from None


# ---- sums of keys over a chunk's queries ---------------------------------------------------------
