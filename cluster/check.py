"""`pdc check SPEC`: what `pdc up SPEC` would trip on, found without starting anything.

After the spec's own validation (proto/spec.py: fields, and how they fit together), the checks
that need the machine, run where `pdc up` would run (the head host):
- the model: its checkpoint at `model.path` (or `model.tiny` to generate it), and which model it is;
- the vLLM the spec's device runs: installed here (cpu, cuda) or the set deploy/setup.sh installs
  for NPUs (vLLM 0.23 + vLLM-Ascend 0.23.0.post1), one the project supports, and one that has
  the model (DeepSeek-V4 is in vLLM 0.32 and later, in no released vLLM-Ascend);
- the device: enough of it on this host for one instance (a GPU, an NPU; CPU cores for
  `cpu_bind`), or the Ray cluster the spec names (`ray_address`), which only `pdc up` reaches;
- the ports every plane binds, free on this host (single host: every instance binds here);
- a router placed on another host (`router.labels`) but listening on loopback.
Each check is a line, `ok`, `warn` or `FAIL`; any FAIL makes the exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.start_diagnosis import ListenPort, PortInUse, check_ports_free, listen_ports
from pdcluster.cluster.vllm_patches_dsv4 import SINCE as DSV4_SINCE
from pdcluster.proto.spec import ClusterSpec
from pdcluster.transfer.vllm_compat import SUPPORTED, installed_version, parsers_refusal

# The NPU set deploy/setup.sh installs (docs/devices.md): vLLM-Ascend's newest on PyPI and its vLLM.
NPU_VLLM, NPU_VLLM_ASCEND = "0.23.0", "0.23.0.post1"
# Model types some supported vLLM versions lack: the versions that have them.
MODEL_SINCE = {"deepseek_v4": DSV4_SINCE}


@dataclass(frozen=True)
class Finding:
    level: str  # "ok" | "warn" | "FAIL"
    what: str

    def __str__(self) -> str:
        return f"{self.level:<4}  {self.what}"


def check(spec: ClusterSpec) -> list[Finding]:
    model_type = _model_type(spec)
    reach = router_reach(spec)
    return [*_model(spec, model_type), *_vllm(spec, model_type), *_device(spec), *_ports(spec),
            *([reach] if reach else [])]


def router_reach(spec: ClusterSpec) -> Finding | None:
    """A router placed on another host (router.labels) that listens on loopback answers no one
    but that host: say so (pdc up says it too)."""
    if spec.router.labels and spec.router.host in ("127.0.0.1", "localhost", "::1"):  # said so: not unset
        return Finding("warn", f"router.labels {spec.router.labels} put the routers on another host, but "
                               f"router.host {spec.router.host} answers only on that host: set router.host to "
                               f"0.0.0.0 (or that host's address) for clients elsewhere")
    return None


def _model_type(spec: ClusterSpec) -> str | None:
    """The checkpoint's model_type, or (no checkpoint here) what its name says."""
    config = Path(spec.model.path) / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type")
        except ValueError:
            return None
    if spec.model.tiny is not None:
        return {"dsv4": "deepseek_v4", "gptoss": "gpt_oss"}.get(spec.model.tiny.arch, spec.model.tiny.arch)
    name = f"{spec.model.path} {spec.model.name or ''}".lower().replace("_", "-")
    return "deepseek_v4" if "deepseek-v4" in name else None


def _model(spec: ClusterSpec, model_type: str | None) -> list[Finding]:
    path = Path(spec.model.path)
    if (path / "config.json").is_file():
        return [Finding("ok", f"model.path {path}: a checkpoint ({model_type or 'model_type not given'})")]
    if spec.model.tiny is not None:
        return [Finding("ok", f"model.path {path}: not there yet; model.tiny generates a {spec.model.tiny.arch} "
                              f"checkpoint at pdc up")]
    guess = f" (its name says {model_type})" if model_type else ""
    level = "FAIL" if spec.device == "cpu" or spec.ray_address is None else "warn"
    return [Finding(level, f"model.path {path}: no config.json on this host{guess}; every host that runs an "
                           f"instance needs the checkpoint at that path")]


def _vllm(spec: ClusterSpec, model_type: str | None) -> list[Finding]:
    if spec.role_engine("prefill").kind == "sim":
        return [Finding("ok", "engine.kind sim: no vLLM needed (the simulated engine)")]
    if spec.device == "npu":
        version, where = NPU_VLLM, f"vLLM {NPU_VLLM} + vLLM-Ascend {NPU_VLLM_ASCEND} (the NPU set deploy/setup.sh installs)"
    else:
        version = installed_version()
        where = f"the installed vLLM {version}"
        if version is None:
            return [Finding("FAIL", "no vLLM installed here (bash deploy/setup.sh; PDC_DEVICE=cuda for GPUs)")]
    out = [Finding("ok" if version in SUPPORTED else "FAIL",
                   f"{where}: {'supported' if version in SUPPORTED else 'not one of ' + ', '.join(SUPPORTED)}")]
    having = MODEL_SINCE.get(model_type or "")
    if having is not None and version not in having:
        extra = " and no released vLLM-Ascend" if spec.device == "npu" else ""
        out.append(Finding("FAIL", f"model {model_type}: {where} does not have it; vLLM {', '.join(having)} do"
                                   f"{extra}"))
    elif model_type is not None:
        out.append(Finding("ok", f"model {model_type}: in {where}"))
    if (spec.model.tool_call_parser or spec.model.reasoning_parser) and (why := parsers_refusal(version)):
        out.append(Finding("FAIL", why))
    return out


def _device(spec: ClusterSpec) -> list[Finding]:
    if spec.role_engine("prefill").kind == "sim":
        return []
    if spec.ray_address not in (None, "auto"):
        return [Finding("warn", f"device {spec.device}: instances run on the Ray cluster at {spec.ray_address} "
                                f"(ray_address); pdc check looks at this host only")]
    if spec.device == "cpu":
        bound = {c for role in ("prefill", "decode") for cores in (getattr(spec, role).resources.cpu_bind or [])
                 for c in _cores(cores)}
        missing = sorted(c for c in bound if c >= (os.cpu_count() or 1))
        if missing:
            return [Finding("FAIL", f"cpu_bind names cores {missing}: this host has {os.cpu_count()}")]
        return [Finding("ok", f"device cpu: {len(os.sched_getaffinity(0))} cores here, "
                              f"{len(bound) or 'none'} pinned by cpu_bind")]
    have = _accelerators(spec.device)
    if have:
        return [Finding("ok", f"device {spec.device}: {have} on this host (one per instance)")]
    # ray_address auto: a Ray cluster this host belongs to may hold them on its other hosts.
    level = "warn" if spec.ray_address == "auto" else "FAIL"
    return [Finding(level, f"device {spec.device}: none on this host" + (
        " (ray_address auto: the Ray cluster's other hosts may have them)" if level == "warn" else ""))]


def _cores(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _accelerators(device: str) -> int:
    if device == "cuda":
        if importlib.util.find_spec("torch") is None:
            return 0
        import torch

        return torch.cuda.device_count()
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch
    import torch_npu  # noqa: F401

    return torch.npu.device_count()


def _ports(spec: ClusterSpec) -> list[Finding]:
    ports = [ListenPort(spec.router.bind_host("127.0.0.1"), spec.router.port, "router.port")]
    for role in ("prefill", "decode"):
        for i in range(getattr(spec, role).instances):
            ports += listen_ports(spec, role, i)
    try:
        check_ports_free(ports)
    except PortInUse as err:
        return [Finding("FAIL", str(err))]
    return [Finding("ok", f"ports: the {len(ports)} this host would bind are free")]
