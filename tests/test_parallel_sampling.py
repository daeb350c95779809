"""D's n choices from one prefill (cluster/parallel_sampling.py), on scripted choices: the others
start only once the first has its first output, every delta names its choice, the last alone
ends the request with the first choice's report, a first choice that fails fails it, and a
consumer that leaves ends every choice."""

from __future__ import annotations

import asyncio

from pdcluster.cluster.parallel_sampling import parallel_samples
from pdcluster.proto.messages import DecodeDelta, EngineTimes, TransferStats

REPORT = TransferStats(d_cached_tokens=0, transferred_tokens=256)


def run(n: int, script, consume=None):
    started, ended = [], []

    async def choice(index, first_output):
        started.append(index)
        try:
            for delta in script(index):
                await asyncio.sleep(0)
                if first_output is not None and delta.new_token_ids:  # as D: at its first token
                    first_output.set()
                yield delta
        finally:
            ended.append(index)

    async def main():
        gen = parallel_samples(n, choice)
        try:
            return await (consume or (lambda g: _all(g)))(gen)
        finally:
            await gen.aclose()

    return asyncio.run(main()), started, ended


async def _all(gen):
    return [d async for d in gen]


def tokens_then(finish, tokens=(7, 8), report=None):
    return [DecodeDelta([t]) for t in tokens] + [DecodeDelta([], finish, report, 256, EngineTimes(1, 2, 3) if report else None)]


def test_the_others_start_after_the_first_output_and_the_last_ends_the_request():
    deltas, started, ended = run(3, lambda i: tokens_then("length", report=REPORT if i == 0 else None))
    assert started[0] == 0 and sorted(started) == [0, 1, 2]
    assert sorted((d.index, tuple(d.new_token_ids)) for d in deltas if d.new_token_ids) == \
        [(i, (t,)) for i in range(3) for t in (7, 8)]
    finishes = [d for d in deltas if d.choice_finish]
    assert sorted(d.index for d in finishes) == [0, 1, 2] and all(d.choice_finish == "length" for d in finishes)
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"] and deltas[-1].finish_reason == "length"
    assert deltas[-1].transfer == REPORT and deltas[-1].engine == EngineTimes(1, 2, 3)  # the first choice's
    assert all(d.transfer is None for d in deltas[:-1]) and sorted(ended) == [0, 1, 2]


def test_a_first_choice_that_fails_before_its_first_output_fails_the_request_alone():
    deltas, started, _ = run(3, lambda i: [DecodeDelta([], "error", REPORT.failed("P gone"))])
    assert [(d.finish_reason, d.index) for d in deltas] == [("error", 0)] and started == [0]


def test_a_consumer_that_leaves_ends_every_choice():
    async def two(gen):
        return [await gen.__anext__(), await gen.__anext__()]

    deltas, started, ended = run(3, lambda i: tokens_then("length", tokens=range(100)), consume=two)
    assert len(deltas) == 2 and sorted(ended) == sorted(started)
