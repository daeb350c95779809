"""A run's request files (router/run_store.py): they rotate past a size, keep a bounded number
of segments, reach the device within the fsync period, and read back streamed, across segments."""

from __future__ import annotations

import os
import threading

import pytest
from test_spec import minimal
from test_timeline_views import write_run

from pdcluster.proto.spec import parse_spec
from pdcluster.router.run_store import FilePolicy, RunStore, iter_records, load_run
from pdcluster.router.timeline import RequestRecord


def rec(i: int) -> RequestRecord:
    return RequestRecord(f"r{i}", prompt_tokens=10, events={"arrival": i * 10, "finish": i * 10 + 5},
                         token_ns=[i * 10_000 + k * 1000 for k in range(20)])


def line_bytes() -> int:
    return len(rec(0).to_json()) + 1


def files(path) -> list[str]:
    return sorted(f.name for f in path.glob("requests*.jsonl"))


def test_a_file_past_its_size_rotates_and_the_run_reads_back_whole_across_segments(tmp_path):
    path = write_run(tmp_path / "run", records=[])
    store = RunStore(path, None, writer=2, policy=FilePolicy(max_file_bytes=3 * line_bytes(), fsync_s=None))
    store.begin(rec(0))  # its begun line in the first segment, its record in a later one
    for i in range(1, 8):
        store.append(rec(i))
    store.append(rec(0))
    store.close()
    assert files(path) == ["requests-2.1.jsonl", "requests-2.2.jsonl", "requests-2.jsonl", "requests.jsonl"]
    assert all(os.path.getsize(path / f) <= 3 * line_bytes() + 200 for f in files(path))
    run = load_run(path)
    assert [r.request_id for r in run.records] == [f"r{i}" for i in range(8)]  # by finish time
    assert run.unfinished == []
    assert [r.request_id for r in iter_records(path)] == [f"r{i}" for i in [1, 2, 3, 4, 5, 6, 7, 0]]
    assert RunStore.new_writer(path, 2) == 3  # a segment is not a writer of its own


def test_past_keep_files_the_oldest_segment_is_deleted_and_logged(tmp_path, caplog):
    path = write_run(tmp_path / "run", records=[])
    store = RunStore(path, None, writer=1, policy=FilePolicy(max_file_bytes=line_bytes(), keep_files=2,
                                                             fsync_s=None))
    for i in range(5):
        store.append(rec(i))  # each line fills a file: 5 segments made
    store.close()
    assert files(path) == ["requests-1.4.jsonl", "requests-1.5.jsonl", "requests-1.jsonl", "requests.jsonl"]
    assert [r.request_id for r in iter_records(path)] == ["r3", "r4"]
    assert "deleted requests-1.1.jsonl (router.record_files_kept=2 reached)" in caplog.text


def test_a_record_reaches_the_device_within_the_fsync_period(tmp_path, monkeypatch):
    path = write_run(tmp_path / "run", records=[])
    synced = threading.Event()
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        synced.set()

    monkeypatch.setattr(os, "fsync", fsync)
    store = RunStore(path, None, writer=1, policy=FilePolicy(fsync_s=0.05))
    try:
        assert not synced.wait(0.2)  # nothing written: nothing synced
        store.append(rec(1))
        assert synced.wait(5)
    finally:
        store.close()
    assert not store._syncer.is_alive()


def test_a_torn_last_line_in_the_current_file_is_skipped_a_bad_line_elsewhere_is_an_error(tmp_path):
    path = write_run(tmp_path / "run", records=[rec(1)])
    with open(path / "requests.jsonl", "a") as f:
        f.write(rec(2).to_json()[:40])  # killed mid-line
    with pytest.warns(RuntimeWarning, match="a torn last line"):
        assert [r.request_id for r in load_run(path).records] == ["r1"]
    with open(path / "requests.jsonl", "a") as f:
        f.write("\n" + rec(3).to_json() + "\n")
    with pytest.raises(ValueError, match=r"requests.jsonl:2: not a request record"):
        load_run(path)


@pytest.mark.parametrize("field, value, message", [
    ("record_file_mb", 0, "record_file_mb"),
    ("record_files_kept", 0, "record_files_kept"),
    ("record_fsync_s", 0, "record_fsync_s"),
])
def test_the_spec_refuses_a_policy_that_cannot_work(field, value, message):
    assert parse_spec(minimal(router={field: None if field != "record_file_mb" else 1}))
    with pytest.raises(ValueError, match=rf"router.{message}"):
        parse_spec(minimal(router={field: value}))
