"""transfer/tier_load_times.py: P's worker writes each prefill's tier load time under its transfer's
id, the engine actor reads it back, in another process, through the instance's shared directory."""

from __future__ import annotations

import multiprocessing

from pdcluster.transfer.tier_load_times import SLOTS, LoadTimes


def _write_in_a_child(path: str) -> None:
    times = LoadTimes(path)
    times.write("pdc-a-1", 1_234_567)
    times.close()


def test_a_time_written_in_another_process_reads_back_by_its_transfer(tmp_path):
    path = str(tmp_path / "tier-loads")
    child = multiprocessing.get_context("spawn").Process(target=_write_in_a_child, args=(path,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    times = LoadTimes(path)
    assert times.read("pdc-a-1") == 1_234_567
    assert times.read("pdc-a-2") == 0  # never written: unknown


def test_a_slot_taken_over_reads_unknown_never_anothers_time(tmp_path):
    times = LoadTimes(str(tmp_path / "tier-loads"))
    ids = [f"pdc-x-{i}" for i in range(3 * SLOTS)]
    for i, tid in enumerate(ids):
        times.write(tid, i + 1)
    got = {tid: times.read(tid) for tid in ids}
    assert all(v in (0, i + 1) for i, v in enumerate(got.values()))  # its own, or unknown
    assert got[ids[-1]] == len(ids)


def test_with_no_shared_directory_nothing_is_kept(monkeypatch):
    monkeypatch.delenv("PDC_REFUSALS_FILE", raising=False)
    times = LoadTimes()
    times.write("t", 5)
    assert (times.path, times.read("t")) == (None, 0)
