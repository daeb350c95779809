"""Loaded at the start of every vLLM engine process whose PYTHONPATH holds this folder
(cluster/engine_actor.py plan_instance() puts it there): applies the vLLM patches
that the PDC_PATCH_* env vars select, all of them in cluster/vllm_patches.py."""

import os

if any(k.startswith("PDC_PATCH_") for k in os.environ):
    from pdcluster.cluster import vllm_patches

    vllm_patches.apply_from_env()
