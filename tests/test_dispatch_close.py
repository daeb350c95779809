"""Closing a request's stream (the client went away, the router stops) ends the request at once:
by the time `aclose()` returns, its record is written and D's call is aborted. The router's stop
waits for the in-flight count to reach 0 and then closes the run's file, so a record written
later (when the garbage collector closes a generator left open) would be lost."""

from __future__ import annotations

import asyncio

from dispatch_fakes import PROMPT, SAMPLING, FakeEngine, make, run, until


def _close_after_first_token(disp, **after) -> tuple[list, int]:
    records: list = []
    disp.sinks.append(records.append)

    async def main():
        gen = disp.generate("r0", PROMPT, SAMPLING)
        await gen.__anext__()
        for name, value in after.items():
            setattr(disp, name, value)
        await gen.aclose()
        return list(records), disp.accepted_in_flight

    return run(main())


def test_closing_the_stream_writes_the_record_and_aborts_d_before_aclose_returns(cancelled):
    d = FakeEngine()
    records, in_flight = _close_after_first_token(make([FakeEngine()], [d]))
    assert [r.error for r in records] == ["cancelled: the client went away or stopped reading"]
    assert records[0].events.get("finish") is not None
    assert cancelled == [d.decode_pending[0]]
    assert in_flight == 0


def test_a_stopping_router_records_the_stop_as_the_reason(cancelled):
    records, _ = _close_after_first_token(make([FakeEngine()], [FakeEngine()]), stopping=True)
    assert [r.error for r in records] == ["cancelled: the router stopped"]


def test_cancelling_the_task_that_drives_the_stream_records_it_too(cancelled):
    # uvicorn cancels a request's task at shutdown; the app then closes the stream (http_app.aclose).
    d = FakeEngine()
    disp = make([FakeEngine()], [d])
    records: list = []
    disp.sinks.append(records.append)

    async def main():
        gen = disp.generate("r0", PROMPT, SAMPLING)

        async def drive():
            async for _ in gen:
                await asyncio.sleep(10)  # the client reads slowly

        task = asyncio.create_task(drive())
        await until(lambda: d.decode_pending and d.decode_pending[0].pos > 0, what="the first token read")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()
        return list(records)

    assert len(run(main())) == 1
    assert cancelled == [d.decode_pending[0]]
