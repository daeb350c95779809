"""Requests moved off an instance lost under them (router/migration.py), over fake engines:
the stream goes on with no token twice or missing, the record and its attribution say what
happened, and the limit and the last instance end it with an error naming them."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from dispatch_fakes import DIED, PROMPT, SAMPLING, FakeEngine, collect, expect_error, make, run

from pdcluster.proto.messages import DecodeDelta
from pdcluster.router.attribution import attribute
from pdcluster.router.pd_dispatch import LOST_GRACE_S
from pdcluster.router.timeline import Migration, RequestRecord


def finish(tokens: list[int]) -> DecodeDelta:
    return DecodeDelta(tokens, finish_reason="length")


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.new_token_ids]


def recorded(disp) -> list:
    records = []
    disp.sinks.append(records.append)
    return records


def test_a_decode_lost_mid_stream_goes_on_on_another_with_the_tokens_sent(cancelled):
    d0 = FakeEngine(decode_script=[DecodeDelta([10]), DecodeDelta([11]), DIED])
    d1 = FakeEngine(decode_script=[DecodeDelta([12]), finish([13])])
    p = FakeEngine()
    disp = make([p], [d0, d1])
    records = recorded(disp)
    chunks = run(collect(disp))
    assert tokens(chunks) == [10, 11, 12, 13]  # none twice, none missing
    assert chunks[-1].finish_reason == "length" and chunks[-1].pd.migrations == 1
    again = d1.decode_calls[0]
    assert again.prompt_token_ids == PROMPT + [10, 11] and again.sampling.max_tokens == SAMPLING.max_tokens - 2
    assert p.prefill_calls[1].prompt_token_ids == PROMPT + [10, 11]  # through P again: P's cache has the prompt
    [rec] = records
    assert rec.error is None and rec.decode_instance == "decode-1" and rec.output_tokens == 4
    [m] = rec.migrations
    assert (m.role, m.lost, m.to, m.tokens_sent) == ("decode", "decode-0", "decode-1", 2)
    assert "first_token" in rec.events and m.at_ns > rec.events["first_token"]
    assert "migration" not in attribute(rec).parts_ns  # after the first token: TTFT is the first D's


def test_a_decode_lost_before_its_first_token_is_sent_again_and_the_lost_time_is_its_own_part(cancelled):
    d0 = FakeEngine(decode_script=[DIED])
    d1 = FakeEngine(decode_script=[DecodeDelta([10]), finish([11])])
    disp = make([FakeEngine()], [d0, d1])
    records = recorded(disp)
    assert tokens(run(collect(disp))) == [10, 11]
    assert d1.decode_calls[0].prompt_token_ids == PROMPT  # nothing was sent: the request as it came
    [rec] = records
    assert [m.tokens_sent for m in rec.migrations] == [0]
    # The second attempt's dispatch: the move and the new pick are one input of the lifecycle, one time.
    assert "dispatch" in rec.events and rec.events["dispatch"] >= rec.migrations[0].at_ns
    assert attribute(rec).parts_ns["migration"] == rec.migrations[0].at_ns - rec.events["arrival"]


def test_the_time_lost_before_the_first_token_is_the_migration_part_and_the_parts_still_sum_to_ttft():
    rec = RequestRecord("r", events={"arrival": 0, "dispatch": 110, "p_scheduled": 150, "p_done": 300,
                                     "d_scheduled": 320, "first_token": 340},
                        migrations=[Migration(60, "decode", "decode-0", 0, "lost"),
                                    Migration(100, "prefill", "prefill-0", 0, "lost", to="prefill-1"),
                                    Migration(400, "decode", "decode-1", 3, "lost", to="decode-2")])  # after: no part
    att = attribute(rec)
    assert att.parts_ns == {"migration": 100, "queue": 50, "prefill": 150, "transfer": 0, "d_wait": 20,
                            "first_decode": 20}
    assert sum(att.parts_ns.values()) == att.ttft_ns == 340 and att.complete
    assert RequestRecord.from_dict(dataclasses.asdict(rec)) == rec  # as load_run reads it back


def test_a_prefill_lost_before_the_first_token_is_retried_on_another_p(cancelled):
    p0, p1 = FakeEngine(prefill_outcome=DIED), FakeEngine()
    disp = make([p0, p1], [FakeEngine()])
    records = recorded(disp)
    assert tokens(run(collect(disp))) == [10, 11, 12, 13]
    assert len(p1.prefill_calls) == 1
    [m] = records[0].migrations
    assert (m.role, m.lost, m.to) == ("prefill", "prefill-0", "prefill-1")
    assert records[0].prefill_instance == "prefill-1"


class DiesLate(FakeEngine):
    """A P whose prefill call fails 50 ms after it is made: after D's tokens came."""

    def call(self, method, req):
        call = super().call(method, req)
        if method == "prefill":
            async def late():
                await asyncio.sleep(0.05)
                raise DIED

            call.next = late
        return call


def test_in_push_mode_a_p_lost_after_d_has_its_kv_does_not_end_the_request(cancelled):
    p = DiesLate()
    d = FakeEngine(decode_queued=True)  # D's tokens come at once
    disp = make([p], [d], mode="push")
    chunks = run(collect(disp))
    assert tokens(chunks) == [10, 11, 12, 13] and chunks[-1].pd.migrations == 0


def test_the_limit_ends_it_with_an_error_naming_the_lost_instances(cancelled):
    ds = [FakeEngine(decode_script=[DecodeDelta([10]), DIED]) for _ in range(3)]
    disp = make([FakeEngine()], ds, migration_limit=1)
    records = recorded(disp)
    err, got = run(expect_error(disp))
    assert err.status == 503 and "already moved 1 times (off decode-0)" in str(err)
    assert str(err).startswith(f"decode instance {records[0].decode_instance} is unavailable")
    assert tokens(got) == [10, 10]  # each attempt's token, each sent once: [10] then, from PROMPT+[10], [10]
    assert [m.lost for m in records[0].migrations] == ["decode-0"] and records[0].error


def test_with_no_decode_left_the_error_names_the_lost_one(cancelled):
    disp = make([FakeEngine()], [FakeEngine(decode_script=[DecodeDelta([10]), DIED])])
    err, got = run(expect_error(disp))
    assert err.status == 503 and str(err).startswith("decode instance decode-0 is unavailable")
    assert "no other decode instance is up" in str(err)
    assert tokens(got) == [10]


def test_lost_after_its_last_token_it_just_finishes(cancelled):
    d0 = FakeEngine(decode_script=[DecodeDelta([10, 11, 12, 13]), DIED])  # all 4 (max_tokens) came, not the finish
    d1 = FakeEngine()
    disp = make([FakeEngine()], [d0, d1])
    chunks = run(collect(disp))
    assert tokens(chunks) == [10, 11, 12, 13] and chunks[-1].finish_reason == "length"
    assert d1.decode_calls == []  # nothing left to generate: no engine asked


def test_limit_zero_is_the_old_behaviour(cancelled):
    disp = make([FakeEngine()], [FakeEngine(decode_script=[DecodeDelta([10]), DIED]), FakeEngine()],
                migration_limit=0)
    err, got = run(expect_error(disp))
    assert err.status == 503 and "decode-0" in str(err) and "already moved 0 times" in str(err)


def test_the_summary_and_the_metrics_count_the_moves(tmp_path):
    from test_timeline_views import write_run

    from pdcluster.router.metrics import RouterMetrics
    from pdcluster.router.run_store import load_run
    from pdcluster.router.timeline_views import format_summary, summarize

    moved = RequestRecord("m", events={"arrival": 0, "first_token": 10, "finish": 20}, output_tokens=2,
                          migrations=[Migration(15, "decode", "D0", 1, "lost", to="D1")])
    run = load_run(write_run(tmp_path / "run", [moved, RequestRecord("n", events={"arrival": 0, "finish": 5})]))
    s = summarize(run)
    assert (s.migrated, s.migrations) == (1, {"decode": 1})
    assert "moved off a lost instance: 1 requests (1 off a lost decode)" in format_summary(s)
    metrics = RouterMetrics(lambda: {})
    metrics.observe(moved)
    assert 'pdc_migrations_total{role="decode"} 1.0' in metrics.render().decode()


class ScriptsInTurn(FakeEngine):
    """A D whose n-th decode call plays scripts[n]; `on_decode` runs as each call is made."""

    def __init__(self, scripts: list[list], on_decode=lambda: None):
        super().__init__()
        self.scripts, self.on_decode = scripts, on_decode

    def call(self, method, req):
        if method == "decode":
            self.decode_script = self.scripts[len(self.decode_calls)]
            self.on_decode()
        return super().call(method, req)


def test_a_kv_load_that_failed_because_p_was_lost_moves_to_another_p(cancelled):
    p0, p1 = FakeEngine(), FakeEngine()
    # P0 answers its prefill, then dies while D loads the KV: D ends the request with 'error'.
    d = ScriptsInTurn([[DecodeDelta([], finish_reason="error")], [DecodeDelta([10]), finish([11])]],
                      on_decode=lambda: setattr(p0, "connected", False) if not d.decode_calls else None)
    disp = make([p0, p1], [d])
    records = recorded(disp)
    assert tokens(run(collect(disp))) == [10, 11]
    [m] = records[0].migrations
    assert (m.role, m.lost, m.to) == ("prefill", "prefill-0", "prefill-1") and "while D loaded its KV" in m.reason


def test_a_kv_load_that_failed_with_p_alive_is_a_502_not_a_move(cancelled):
    d = FakeEngine(decode_script=[DecodeDelta([], finish_reason="error")])
    disp = make([FakeEngine(), FakeEngine()], [d])
    disp_start = time.monotonic()
    err, _ = run(expect_error(disp))
    assert err.status == 502 and err.kind == "kv_transfer_error" and len(d.decode_calls) == 1
    assert time.monotonic() - disp_start >= LOST_GRACE_S  # it waited to learn whether P was lost


def test_each_attempt_is_a_new_request_to_the_engines(cancelled):
    """In push mode the first attempt's prefill is aborted on P as the second starts: under one
    request id P's engine would mix their blocks (found by the C90 chaos soak: D's check of the
    KV it received failed, 5 of 41 moved requests)."""
    p = FakeEngine()
    d0 = FakeEngine(decode_script=[DIED])
    disp = make([p], [d0, FakeEngine()], mode="push")
    run(collect(disp, "r9"))
    first, second = p.prefill_calls
    assert first.request_id != second.request_id and first.transfer_id != second.transfer_id
