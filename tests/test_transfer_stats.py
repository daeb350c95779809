"""D's transfer report (proto/messages.py TransferStats): planned, pulled, failed, and across
vLLM's boundary as builtins."""

from __future__ import annotations

import msgspec
import pytest

from pdcluster.proto.messages import TransferStats


def planned(**kw) -> TransferStats:
    """D holds 256 tokens, 512 come from P: 4 blocks of group 0 (100 B each), 1 of group 1 (7 B)."""
    args = dict(d_cached_tokens=256, transferred_tokens=512, blocks_per_group=(4, 1), bytes_per_block=(100, 7)) | kw
    return TransferStats.planned(**args)


def test_a_plan_counts_each_groups_blocks_and_bytes():
    s = planned(transfer_start_ns=5)
    assert (s.blocks_per_group, s.bytes_per_group, s.transfer_start_ns, s.error) == ((4, 1), (400, 7), 5, None)


def test_a_pull_sets_its_times_and_what_moved():
    s = planned().pulled(10, 30)
    assert (s.transfer_start_ns, s.transfer_end_ns, s.bytes_per_group) == (10, 30, (400, 7))
    assert planned().pulled(10, 30, [380, 7]).bytes_per_group == (380, 7)


def test_a_failure_leaves_no_tokens_or_blocks_and_says_why():
    s = planned().pulled(10, 30, (200, 0)).failed("KV pull from P failed")
    assert (s.d_cached_tokens, s.transferred_tokens, s.blocks_per_group) == (0, 0, (0, 0))
    assert (s.error, s.bytes_per_group, s.transfer_end_ns) == ("KV pull from P failed", (200, 0), 30)
    s = planned().failed("mismatch", end_ns=40, moved_bytes=(0, 0))
    assert (s.bytes_per_group, s.transfer_end_ns) == ((0, 0), 40)


def test_it_crosses_vllms_boundary_as_builtins_and_comes_back_checked():
    s = planned().pulled(10, 30)
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_params()))  # as EngineCore's msgpack carries it
    assert isinstance(params, dict) and TransferStats.from_params(params) == s
    assert TransferStats.from_params(None) is None
    with pytest.raises(msgspec.ValidationError, match="blocks_per_group"):
        TransferStats.from_params(params | {"blocks_per_group": "many"})


def d_connector(*request_ids: str):
    """D's connector, scheduler side only, each request planned."""
    from pdcluster.transfer.connector import PdcConnector
    from pdcluster.transfer.connector_loads import Loads
    from pdcluster.transfer.vllm_compat import API

    conn = object.__new__(PdcConnector)
    conn._tier = None
    conn._loads = Loads((), None, failed_recving=API["0.32.0"].failed_recving)
    conn._loads._loading = set(request_ids)
    conn._loads.reports = {r: planned() for r in request_ids}
    return conn


def test_a_failed_pull_says_why_whichever_step_the_workers_word_comes_in():
    from vllm.v1.outputs import KVConnectorOutput

    from pdcluster.transfer.connector_meta import PullTimings
    from pdcluster.transfer.grpc_client import PullTiming

    why = "UNAVAILABLE from P at 10.0.0.1:5000: Socket closed"
    conn = d_connector("a", "b")
    timing = PullTiming(10, 30, (0, 0), why)
    conn.update_connector_output(KVConnectorOutput(failed_recving={"a"}, kv_connector_worker_meta=PullTimings({"a": timing})))
    conn.update_connector_output(KVConnectorOutput(failed_recving={"b"}))  # its timing a step later
    assert conn._loads.reports["b"].error == "KV pull from P failed"
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=PullTimings({"b": timing})))
    assert conn._loads.reports["a"].error == conn._loads.reports["b"].error == f"KV pull from P failed: {why}"
    ok = d_connector("c")
    ok.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=PullTimings({"c": PullTiming(10, 30, (200, 0))})))
    assert ok._loads.reports["c"].error is None and ok._loads.reports["c"].transfer_end_ns == 30
