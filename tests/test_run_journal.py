"""A run's file says which requests came in, not only which ended (router/timeline.py): a
request whose router crashed before it ended is still counted, as unfinished; one ended by
the router's stop is recorded as such."""

from __future__ import annotations

import asyncio

import pytest
from dispatch_fakes import HANG, PROMPT, SAMPLING, FakeEngine, collect, make, run
from test_timeline_views import sample_records, write_run

from pdcluster.proto.messages import DecodeDelta
from pdcluster.router.run_store import RunStore, load_run
from pdcluster.router.timeline_views import format_summary, summarize


def journaled(disp, path):
    """The dispatcher writing into the run at `path` as the router does (begin + record)."""
    store = RunStore(path, None, writer=1)
    disp.begin_sinks.append(store.begin)
    disp.sinks.append(store.append)
    return store


def test_a_request_in_flight_at_a_crash_is_unfinished_and_its_record_ends_that(tmp_path):
    path = write_run(tmp_path / "run")
    disp = make([FakeEngine()], [FakeEngine(decode_script=[DecodeDelta([10]), HANG])])
    journaled(disp, path)

    async def first_token_then_crash():
        stream = disp.generate("r-crash", PROMPT, SAMPLING)
        assert (await anext(stream)).new_token_ids == [10]
        with pytest.warns(RuntimeWarning, match="1 requests came in and have no record"):
            run_ = load_run(path)  # what is on disk now, as after a kill -9 of the router
        await stream.aclose()
        return run_

    crashed = run(first_token_then_crash())
    assert [(u.request_id, u.file) for u in crashed.unfinished] == [("r-crash", "requests-1.jsonl")]
    assert crashed.unfinished[0].arrival_ns is not None
    assert ", 1 unfinished (their router stopped first)" in format_summary(summarize(crashed)).splitlines()[0]
    assert sorted(r.request_id for r in crashed.records) == sorted(r.request_id for r in sample_records())

    ended = load_run(path)  # the stream was closed: its record follows its begun line
    assert ended.unfinished == []
    assert ended.record("r-crash").error == "cancelled: the client went away or stopped reading"


def test_a_request_ended_by_the_routers_stop_says_so(tmp_path):
    path = write_run(tmp_path / "run")
    disp = make([FakeEngine()], [FakeEngine(decode_script=[DecodeDelta([10]), HANG])])
    store = journaled(disp, path)

    async def stopped_mid_stream():
        stream = disp.generate("r-stop", PROMPT, SAMPLING)
        await anext(stream)
        disp.stopping = True  # RouterActor.stop, before uvicorn cancels what still runs
        task = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(stopped_mid_stream())
    store.close()
    got = load_run(path)
    assert got.unfinished == []
    assert got.record("r-stop").error == "cancelled: the router stopped"


def test_a_begun_line_with_its_record_is_not_unfinished_and_a_torn_one_is_skipped(tmp_path):
    path = write_run(tmp_path / "run", [])
    requests = path / "requests.jsonl"
    rec = sample_records()[0]
    store = RunStore(path, None, writer=1)
    store.begin(rec)
    store.append(rec)
    store.close()
    requests.write_text('{"begun": "r-torn", "arr')  # the router died writing a begun line
    with pytest.warns(RuntimeWarning, match="torn last line"):
        got = load_run(path)
    assert [r.request_id for r in got.records] == [rec.request_id] and got.unfinished == []


def test_a_full_disk_fails_no_request_and_is_counted_and_logged_once(tmp_path, caplog):
    """Issue 26 item 7: with the records file on a full device every request got a 500 and no
    engine was called. /dev/full: every write fails with ENOSPC."""
    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d])
    store = journaled(disp, write_run(tmp_path / "run"))
    store._file = open("/dev/full", "a", buffering=1)
    failed = []
    disp.sink_failure_listeners.append(failed.append)
    with caplog.at_level("ERROR", logger="pdcluster.router.pd_dispatch"):
        for rid in ("r0", "r1", "r2"):
            assert run(collect(disp, rid))[-1].finish_reason == "length"
    assert len(d.decode_calls) == 3 and disp.accepted_in_flight == 0
    assert failed == ["RunStore.begin", "RunStore.append"] * 3
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all("No space left on device" in m for m in logged), logged
