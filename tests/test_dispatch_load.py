"""P's load as the picker sees it counts from the pick, before the dispatcher awaits anything:
two requests a moment apart must not both see an idle P (the virtual clock, cluster/sim/virtual,
counts it so too)."""

from __future__ import annotations

import asyncio

import pytest
from dispatch_fakes import HANG, PROMPT, SAMPLING, FakeEngine, make, run, until


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_request_right_behind_another_sees_its_load_on_p(cancelled, mode):
    # prefill-0 works on a short prompt; then two long ones come at once. The first takes the
    # idle prefill-1; the second must see it there (a long prompt queued) and take prefill-0.
    # (In push mode P's call starts in a task of its own, a loop turn after the pick: counted
    # only then, the second request saw prefill-1 idle too. Pull mode awaits it at once.)
    ps = [FakeEngine(prefill_outcome=HANG), FakeEngine(prefill_outcome=HANG)]
    disp = make(ps, [FakeEngine(decode_script=[HANG])], mode=mode, policy="least_load")
    long_prompt = PROMPT * 8

    async def main():
        short = asyncio.create_task(disp.generate("short", PROMPT, SAMPLING).__anext__())
        await until(lambda: sum(len(p.prefill_calls) for p in ps) == 1, what="the short request's prefill")
        assert [len(p.prefill_calls) for p in ps] == [1, 0], "the short request should be on prefill-0"
        longs = [asyncio.create_task(disp.generate(f"long{i}", long_prompt, SAMPLING).__anext__()) for i in range(2)]
        await until(lambda: sum(len(p.prefill_calls) for p in ps) == 3, what="both long requests' prefills")
        calls = [[len(r.prompt_token_ids) for r in p.prefill_calls] for p in ps]
        for t in [short, *longs]:
            t.cancel()
        await asyncio.gather(short, *longs, return_exceptions=True)
        return calls

    calls = run(main())
    assert calls == [[len(PROMPT), len(PROMPT) * 8], [len(PROMPT) * 8]], calls


def test_an_attempt_that_ends_before_p_answers_leaves_no_load_on_p(cancelled):
    ps = [FakeEngine(prefill_outcome=HANG)]
    disp = make(ps, [FakeEngine()], mode="push", policy="least_load")

    async def main():
        gen = disp.generate("r0", PROMPT, SAMPLING)
        await gen.__anext__()  # D answers in push mode while P still works
        await gen.aclose()
        return disp.picker.in_flight()

    assert run(main())["prefill-0"] == 0


def test_an_instance_in_a_long_step_gives_its_last_tier_counts_and_a_down_one_none():
    """/metrics asks each instance's tier (router/server.py): a P in a long prefill step answers
    only after it, and its counters must neither hold up the page nor vanish from it."""
    from dispatch_fakes import FakeRef, Method

    from pdcluster.proto.messages import TierCounts

    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d])
    p.tier_counts = Method(lambda: FakeRef(TierCounts(stored_blocks=3)))
    d.tier_counts = Method(lambda: FakeRef(None))  # no tier

    async def main():
        first = await disp.tier_counts()
        p.tier_counts = Method(lambda: asyncio.sleep(30))  # in its step
        in_step = await disp.tier_counts()
        p.connected = False
        return first, in_step, await disp.tier_counts()

    first, in_step, down = run(main())
    assert first == in_step == {"prefill-0": TierCounts(stored_blocks=3)} and down == {}
