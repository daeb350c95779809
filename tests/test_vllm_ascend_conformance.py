"""The NPU path against vLLM-Ascend 0.23.0.post1's own source (issue 17 item 4), statically:
its model runner is vLLM's GPUModelRunner with its own KV tensors, so the connector is driven
by vLLM 0.23's hooks (get_finished, failed loads as blocks: transfer/vllm_compat.py), and its
KV comes as a tuple per layer (transfer/paged_kv.py moves each part; tests/test_npu_kv_layout.py).
What only an NPU can show is in docs/devices.md's version matrix."""

from __future__ import annotations

import ast

import pytest
from vllm_source_ast import Source, fetched

from pdcluster.proto.devices import DEVICES
from pdcluster.transfer.vllm_compat import API

PINS = DEVICES["npu"].pins
RUNNER = "vllm_ascend.worker.model_runner_v1"


@pytest.fixture(scope="module")
def ascend() -> Source:
    return Source(fetched(f"vllm-ascend-{PINS['vllm-ascend']}"))


def test_the_npu_runner_is_vllms_gpu_runner_with_vllms_connector_hooks(ascend):
    _, cls = ascend.find_class(RUNNER, "NPUModelRunner")
    assert [b.id for b in cls.bases if isinstance(b, ast.Name)] == ["GPUModelRunner"]
    own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    # vLLM's KVConnectorModelRunnerMixin asks the connector for its results: not overridden.
    assert not own & {"maybe_get_kv_connector_output", "get_finished_kv_transfers"}, own
    assert API[PINS["vllm"]].transfer_results is False  # so: get_finished(), failed loads as blocks


def test_nothing_in_vllm_ascend_calls_the_newer_results_hook(ascend):
    callers = [str(p.relative_to(ascend.root)) for p in (ascend.root / "vllm_ascend").rglob("*.py")
               if "get_transfer_results(" in p.read_text()]
    assert callers == []


def test_its_kv_is_registered_as_a_tuple_per_layer(ascend):
    text = ascend.module_file(RUNNER).read_text()
    assert "get_kv_transfer_group().register_kv_caches(kv_caches)" in text
    for form in ("kv_caches[layer_name] = (k_cache, v_cache)", "kv_caches[layer_name] = (k_cache, dsa_k_cache)"):
        assert form in text, f"NPUModelRunner no longer registers {form}: recheck transfer/paged_kv.py"


def test_its_own_scheduler_builds_the_connectors_metadata_as_vllms_does(ascend):
    text = ascend.module_file("vllm_ascend.patch.platform.patch_balance_schedule").read_text()
    assert "self.connector.build_connector_meta(scheduler_output)" in text
