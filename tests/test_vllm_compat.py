"""The adapters transfer/vllm_compat.py names for vLLM < 0.32, on vLLM-shaped fakes: P's
block tables rebuilt from the scheduled requests, and D's failed load reported the old way
(through get_finished, as the failed request's blocks)."""

from __future__ import annotations

from types import SimpleNamespace

from pdcluster.proto.handle import TransferHandle
from pdcluster.transfer.connector import PdcConnector, PdcMetadata, _Worker
from pdcluster.transfer.grpc_client import LoadJob, LoadResults
from pdcluster.transfer.plan import GroupPlan, TransferPlan
from pdcluster.transfer.vllm_compat import API, BlockTables, TransferResults


def scheduled(new=(), cached=(), resumed=()):
    """A SchedulerOutput as vLLM 0.23 / 0.26 builds it: new requests with their whole table,
    cached ones with the blocks this step added (None: none)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], new_block_ids=[b for _, b in cached],
                                              resumed_req_ids=set(resumed)))


def test_block_tables_follow_new_appended_and_resumed_requests():
    tables = BlockTables()
    tables.update(scheduled(new=[("a", ([1, 2],)), ("b", ([5],))]))
    tables.update(scheduled(cached=[("a", ([3],)), ("b", None)]))  # a chunk more for a; b nothing new
    assert tables.get_block_ids("a") == ([1, 2, 3],) and tables.get_block_ids("b") == ([5],)
    tables.update(scheduled(cached=[("a", ([7, 8, 9],))], resumed=["a"]))  # preempted, then back in new blocks
    assert tables.get_block_ids("a") == ([7, 8, 9],)
    tables.forget("a")
    assert set(tables.tables) == {"b"}


class FakeFetcher:
    def __init__(self):
        self.submitted: list[LoadJob] = []
        self.results = LoadResults()

    def submit(self, job: LoadJob) -> None:
        self.submitted.append(job)

    def take_results(self) -> LoadResults:
        out, self.results = self.results, LoadResults()
        return out


def old_vllm_d(version: str = "0.26.0") -> tuple[PdcConnector, FakeFetcher]:
    """D's connector as on `version`, its worker's fetcher a fake (no KV, no network)."""
    conn = object.__new__(PdcConnector)
    conn.api = API[version]
    worker = object.__new__(_Worker)
    worker.sources, worker.fetcher, worker._timings = None, FakeFetcher(), {}
    worker._failed_as_blocks = not conn.api.transfer_results
    worker._load_blocks, worker._error_blocks = {}, set()
    worker.tier, worker._tier_lost, worker._tier_failed, worker._tier_freed, worker._tier_loads = None, [], [], set(), {}
    conn._worker = worker
    return conn, worker.fetcher


def load(request_id: str, blocks: tuple[int, ...]) -> LoadJob:
    handle = TransferHandle("p0", "10.0.0.1:5000", request_id, len(blocks) * 16)
    plan = TransferPlan((GroupPlan(0, "full_attention", tuple(range(len(blocks))), blocks),), 0, len(blocks) * 16)
    return LoadJob(request_id, handle, plan)


def test_on_old_vllm_a_failed_load_is_its_blocks_and_finished_through_get_finished():
    conn, fetcher = old_vllm_d("0.26.0")
    conn._worker.start(PdcMetadata(loads=[load("ok", (4, 5)), load("bad", (6, 7, 8))]))
    fetcher.results = LoadResults(finished={"ok", "bad"}, failed={"bad"})
    assert conn.get_finished(set()) == (None, {"ok", "bad"})  # the failed one must end its wait too
    assert conn.get_block_ids_with_load_errors() == {6, 7, 8}
    assert conn.get_block_ids_with_load_errors() == set()  # reported once
    assert conn._worker._load_blocks == {}  # nothing kept past the loads' end


def test_on_new_vllm_failed_loads_are_not_also_reported_as_blocks():
    conn, fetcher = old_vllm_d("0.32.0")
    conn._worker.start(PdcMetadata(loads=[load("bad", (6, 7))]))
    fetcher.results = LoadResults(finished={"bad"}, failed={"bad"})
    results = conn.get_transfer_results(set())
    assert results.failed_recving == {"bad"} and conn.get_block_ids_with_load_errors() == set()


def test_the_results_shim_has_vllm_032s_fields():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    assert set(TransferResults.__dataclass_fields__) == set(KVConnectorTransferResults.__dataclass_fields__)


def test_a_patch_is_installed_only_on_its_versions():
    from pdcluster.cluster.vllm_hooks import Patch

    calls = []
    patch = Patch("p", lambda: calls.append(1), ("0.32.0", "0.33.0"))
    assert not patch.install("0.34.0") and calls == []
    assert patch.install("0.33.0") and calls == [1]


def test_the_v2_runner_switch_is_not_set_on_versions_without_it(monkeypatch):
    import os

    from pdcluster.cluster import vllm_patches
    from pdcluster.transfer import vllm_compat

    monkeypatch.setattr(vllm_compat, "installed_version", lambda: "0.34.0")
    monkeypatch.setitem(vllm_patches._PATCH_SETS, "dsv4_cpu", ())  # the env only: no hooks in this process
    monkeypatch.setattr(vllm_patches, "_applied", set())
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    vllm_patches.apply("dsv4_cpu")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ and os.environ["TRITON_INTERPRET"] == "1"


def test_spec_fields_are_read_under_each_versions_name():
    from pdcluster.transfer.vllm_compat import bounded_replay, tokens_per_state

    assert tokens_per_state(SimpleNamespace(tokens_per_state=4)) == 4  # 0.32 and later
    assert tokens_per_state(SimpleNamespace(compress_ratio=128)) == 128  # 0.23, 0.26
    assert tokens_per_state(SimpleNamespace()) == 1
    assert bounded_replay(SimpleNamespace(bounded_replay=True)) and not bounded_replay(SimpleNamespace())
