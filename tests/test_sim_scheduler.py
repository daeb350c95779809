"""The simulated engine's scheduler, without Ray: batching, chunking, budgets, D waiting for its KV,
preemption, stop rules, timing."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from pdcluster.cluster.sim.block_pool import BlockPool
from pdcluster.cluster.sim.request import SimRequest, Status, context_token
from pdcluster.cluster.sim.scheduler import KvHooks, Scheduler, SchedulerConfig

BS = 16
VOCAB = 1000


@dataclass
class RecordingCost:
    """Each step's shape, and a fixed duration per step."""

    step_s: float = 0.0
    steps: list[tuple[tuple, tuple]] = field(default_factory=list)  # (prefill chunks, decode context lens)

    def prefill_step_s(self, chunks):
        self.steps.append((tuple(chunks), ()))
        return self.step_s

    def decode_step_s(self, context_lens):
        self.steps.append(((), tuple(context_lens)))
        return self.step_s

    def mixed_step_s(self, chunks, context_lens):
        self.steps.append((tuple(chunks), tuple(context_lens)))
        return self.step_s


def config(**kw) -> SchedulerConfig:
    base = dict(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512, vocab_size=VOCAB,
                eos_token_id=None)
    return SchedulerConfig(**{**base, **kw})


def request(rid: str, n: int, max_tokens: int = 4, first: int = 0, **kw) -> SimRequest:
    return SimRequest(rid, [(first + i) % VOCAB for i in range(n)], max_tokens, **kw)


async def serve(sched: Scheduler, reqs: list[SimRequest], during=None, timeout: float = 10,
                in_turn: bool = False) -> dict[str, list]:
    """Run the loop until every request finished (all at once, or each after the previous
    one ended); the deltas per request."""
    loop_task = asyncio.ensure_future(sched.run())
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    if in_turn:
        for r in reqs:
            sched.add(r)
            while (d := await r.out.get()).finish_reason is None:
                out[r.request_id].append(d)
            out[r.request_id].append(d)
        sched.stop()
        await loop_task
        return out
    for r in reqs:
        sched.add(r)

    async def drain(r):
        while True:
            d = await r.out.get()
            out[r.request_id].append(d)
            if d.finish_reason is not None:
                return

    try:
        drains = asyncio.gather(*(drain(r) for r in reqs))
        if during is not None:
            await during()
        await asyncio.wait_for(drains, timeout)
    finally:
        sched.stop()
        await loop_task
    return out


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def make(cost=None, hooks=None, blocks: int = 64, **kw) -> tuple[Scheduler, RecordingCost]:
    cost = cost or RecordingCost()
    return Scheduler(config(**kw), BlockPool(blocks, BS), cost, hooks), cost


def test_prompts_batch_within_the_token_budget_then_decode_together():
    sched, cost = make()
    a, b = request("a", 30), request("b", 20, first=500)
    out = asyncio.run(serve(sched, [a, b]))
    # Step 1: both prompts (50 <= 64 tokens); then both decode in every step.
    assert cost.steps[0] == (((30, 0), (20, 0)), ())
    assert cost.steps[1] == ((), (31, 21))
    assert len(cost.steps) == 4  # 1 prefill step (1st token) + 3 decode steps
    for r in (a, b):
        assert len(tokens_of(out[r.request_id])) == 4 and out[r.request_id][-1].finish_reason == "length"
    sched.pool.check_integrity()
    assert sched.pool.num_held == 0 and not sched.requests


def test_long_prompt_is_chunked_by_the_budget_and_the_per_request_threshold():
    sched, cost = make()
    asyncio.run(serve(sched, [request("a", 150, max_tokens=1)]))
    assert [s[0] for s in cost.steps] == [((64, 0),), ((64, 64),), ((22, 128),)]
    sched, cost = make(long_prefill_token_threshold=40)
    asyncio.run(serve(sched, [request("a", 100, max_tokens=1), request("b", 10, max_tokens=1, first=300)]))
    # vLLM's cap per request: a takes 40 of the 64, b the next 10, in the same step.
    assert cost.steps[0] == (((40, 0), (10, 0)), ())
    assert [s[0] for s in cost.steps[1:]] == [((40, 40),), ((20, 80),)]


def test_at_most_max_num_seqs_run_the_rest_wait_in_arrival_order():
    sched, cost = make(max_num_seqs=2)
    reqs = [request(str(i), 8, max_tokens=2, first=100 * i) for i in range(3)]
    asyncio.run(serve(sched, reqs))
    assert cost.steps[0] == (((8, 0), (8, 0)), ())
    # The third enters when a slot frees, beside nothing else (the first two are done).
    assert cost.steps[2] == (((8, 0),), ())
    assert reqs[2].scheduled_ns > reqs[0].first_token_ns


def test_prefix_hit_on_a_second_request_of_the_family_never_the_whole_prompt():
    sched, cost = make()
    family = list(range(40))
    a = SimRequest("a", family + [900], 1)
    b = SimRequest("b", family + [901, 902], 1)
    c = SimRequest("c", family[:32], 1)  # exactly 2 blocks, both cached: the last token is computed anyway
    asyncio.run(serve(sched, [a, b, c], in_turn=True))
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 32, 16)
    assert cost.steps[-1][0] == ((16, 16),)
    sched.pool.check_integrity()


class LoadLater(KvHooks):
    """D's hooks: loads end only when the test says so."""

    def __init__(self):
        self.started: list[SimRequest] = []

    def start_load(self, req):
        self.started.append(req)


def test_d_waits_for_its_kv_then_computes_only_the_last_token():
    hooks = LoadLater()
    sched, cost = make(hooks=hooks)
    d = request("d", 40, max_tokens=3, external_tokens=40)

    async def finish_load_later():
        await asyncio.sleep(0.1)
        assert hooks.started == [d] and d.status is Status.LOADING
        assert cost.steps == [] and d.out.empty()  # nothing computed while the KV is on its way
        assert len(d.blocks) == 3  # the whole prompt's blocks, taken before the load
        sched.load_ended("d", None)

    out = asyncio.run(serve(sched, [d], during=finish_load_later))
    # vLLM recomputes the last prompt token for its logits: one query over a 40-token context,
    # shaped (and costed) as a decode step.
    assert cost.steps[0] == ((), (40,))
    assert len(tokens_of(out["d"])) == 3
    assert d.kv_ready_ns <= d.scheduled_ns <= d.first_token_ns
    # The loaded blocks are cached: the same prompt hits them now.
    assert len(sched.pool.find_hit(d.block_hashes, 39)) == 2
    sched.pool.check_integrity()


@pytest.mark.parametrize("recompute", [False, True])
def test_failed_load_errors_or_recomputes_and_frees_its_blocks(recompute):
    hooks = LoadLater()
    sched, cost = make(hooks=hooks, recompute_on_load_failure=recompute)
    d = request("d", 40, max_tokens=2, external_tokens=40)

    async def fail_load():
        await asyncio.sleep(0.05)
        sched.load_ended("d", "P went away")

    out = asyncio.run(serve(sched, [d], during=fail_load))
    if recompute:
        assert cost.steps[0] == (((40, 0),), ()) and out["d"][-1].finish_reason == "length"
    else:
        assert cost.steps == [] and out["d"][-1].finish_reason == "error" and d.error == "P went away"
    assert sched.pool.num_held == 0 and not sched.requests
    sched.pool.check_integrity()


class FailAtOnce(KvHooks):
    """D's hooks: the load fails as it starts (P's lease ran out before D asked)."""

    def __init__(self):
        self.scheduler = None

    def start_load(self, req):
        self.scheduler.load_ended(req.request_id, "P's lease ran out")


@pytest.mark.parametrize("recompute", [False, True])
def test_a_load_that_fails_as_it_starts_errors_or_recomputes(recompute):
    hooks = FailAtOnce()
    sched, cost = make(hooks=hooks, recompute_on_load_failure=recompute)
    hooks.scheduler = sched
    d = request("d", 40, max_tokens=2, external_tokens=40)
    other = request("o", 8, max_tokens=2, first=500)
    out = asyncio.run(serve(sched, [d, other]))
    assert out["d"][-1].finish_reason == ("length" if recompute else "error") and d.error == "P's lease ran out"
    assert out["o"][-1].finish_reason == "length"
    assert sched.pool.num_held == 0 and not sched.requests and not sched.waiting
    sched.pool.check_integrity()


def test_abort_while_loading_keeps_the_blocks_until_the_load_ends():
    hooks = LoadLater()
    sched, _ = make(hooks=hooks)
    d = request("d", 40, external_tokens=40)

    async def abort_then_end_load():
        await asyncio.sleep(0.05)
        sched.abort("d")
        assert sched.pool.num_held == 3  # the fetch may still write into them
        sched.load_ended("d", "cancelled")

    out = asyncio.run(serve(sched, [d], during=abort_then_end_load))
    assert out["d"][-1].finish_reason == "abort"
    assert sched.pool.num_held == 0 and not sched.requests
    sched.pool.check_integrity()


class HoldForTransfer(KvHooks):
    def __init__(self):
        self.computed_ranges = []

    def computed(self, req, start, end):
        self.computed_ranges.append((req.request_id, start, end))

    def finished(self, req):
        return True


def test_p_keeps_blocks_after_finishing_until_released_and_reports_each_chunk():
    hooks = HoldForTransfer()
    sched, _ = make(hooks=hooks)
    p = request("p", 100, max_tokens=1)
    asyncio.run(serve(sched, [p]))
    assert hooks.computed_ranges == [("p", 0, 64), ("p", 64, 100)]
    assert sched.pool.num_held == 7 and "p" in sched.held
    sched.release({"p"})
    assert sched.pool.num_held == 0 and not sched.requests
    sched.pool.check_integrity()


def test_out_of_blocks_preempts_the_latest_and_everything_still_finishes():
    sched, _ = make(blocks=9, max_num_seqs=4, max_num_batched_tokens=128)  # 8 usable blocks
    reqs = [request(str(i), 30, max_tokens=40, first=100 * i) for i in range(3)]  # 5 blocks each at the end
    out = asyncio.run(serve(sched, reqs))
    assert all(len(tokens_of(out[r.request_id])) == 40 for r in reqs)
    assert sum(r.preemptions for r in reqs) > 0
    # A preempted request's output is the same as without preemption (same contexts, same positions).
    assert tokens_of(out["2"]) == expected_output(reqs[2].prompt_token_ids, 40)
    sched.pool.check_integrity()
    assert sched.pool.num_held == 0


def test_a_prompt_that_can_never_fit_fails_at_once():
    sched, _ = make(blocks=4)
    with pytest.raises(ValueError, match="needs 4 KV blocks, the pool has 3"):
        sched.add(request("big", 60))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(request("long", 512))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sched.add(SimRequest("bad", [1, VOCAB], 1))


def test_stop_rules_eos_stop_ids_and_determinism():
    probe = request("x", 10, max_tokens=1)
    first, second = expected_output(probe.prompt_token_ids, 2)
    # EOS ends the request unless ignore_eos; a stop id ends it too; the stop token is in the output.
    sched, _ = make(eos_token_id=first)
    out = asyncio.run(serve(sched, [request("a", 10, max_tokens=5)]))
    assert tokens_of(out["a"]) == [first] and out["a"][-1].finish_reason == "stop"
    sched, _ = make(eos_token_id=first)
    out = asyncio.run(serve(sched, [request("a", 10, max_tokens=5, ignore_eos=True,
                                            stop_token_ids=frozenset({second}))]))
    assert tokens_of(out["a"]) == [first, second] and out["a"][-1].finish_reason == "stop"
    # Same prompt, same tokens, whatever the instance.
    s1, _ = make()
    s2, _ = make()
    assert tokens_of(asyncio.run(serve(s1, [request("a", 10)]))["a"]) == \
        tokens_of(asyncio.run(serve(s2, [request("z", 10)]))["z"])


def test_steps_take_the_cost_models_time_and_tokens_go_out_in_batches():
    sched, cost = make(cost=RecordingCost(step_s=0.02), delta_interval_s=0.1)
    t0 = time.monotonic()
    out = asyncio.run(serve(sched, [request("a", 10, max_tokens=20)]))
    elapsed = time.monotonic() - t0
    assert len(cost.steps) == 20
    # Never faster than the model; slower only by what a loaded machine withholds.
    assert 0.4 <= elapsed < 0.4 + 0.5, f"20 steps of 20 ms took {elapsed:.3f} s"
    deltas = out["a"]
    assert len(deltas[0].token_ids) == 1  # the first token at once
    assert 3 <= len(deltas) <= 7  # then about one batch per 100 ms, not one per token
    ns = [t for d in deltas for t in d.token_ns]
    assert len(ns) == 20 and ns == sorted(set(ns)), "a token's time is its own step's end, not its batch's"
    assert (ns[-1] - ns[0]) / 1e6 >= 19 * 20 * 0.99


def test_a_failing_loop_ends_every_request_instead_of_leaving_it_waiting():
    class BrokenCost(RecordingCost):
        def prefill_step_s(self, chunks):
            raise RuntimeError("cost model bug")

    async def run():
        sched, _ = make(cost=BrokenCost())
        loop_task = asyncio.ensure_future(sched.run())
        reqs = [sched.add(request("a", 10)), sched.add(request("b", 10, first=500))]
        deltas = [await asyncio.wait_for(r.out.get(), 5) for r in reqs]
        with pytest.raises(RuntimeError, match="cost model bug"):
            await loop_task
        return reqs, deltas

    reqs, deltas = asyncio.run(run())
    assert [d.finish_reason for d in deltas] == ["error", "error"]
    assert all("cost model bug" in r.error for r in reqs)


def expected_output(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(context_token(prompt + out, len(prompt) + len(out), VOCAB))
    return out


def test_a_request_sent_again_with_the_tokens_it_had_goes_on_with_the_same_tokens():
    """What a migration relies on (router/migration.py): prompt + first k tokens, asked for the
    rest, gives the rest of the uninterrupted output, as a greedy model would."""
    prompt = request("p", 40).prompt_token_ids
    whole = asyncio.run(serve(make()[0], [request("w", 40, max_tokens=30)]))["w"]
    assert tokens_of(whole) == expected_output(prompt, 30)
    head = tokens_of(whole)[:12]
    rest = asyncio.run(serve(make()[0], [SimRequest("r", prompt + head, 18)]))["r"]
    assert head + tokens_of(rest) == tokens_of(whole)


def test_an_abort_during_a_step_ends_the_request_after_it_as_vllm_does():
    """The step's blocks are hittable from its schedule on (and on P, wanted by D): an abort that
    came while it ran must not free them before the step's chunk is reported computed (the C90
    chaos soak found a later request hitting such blocks with their content never written)."""
    hooks = HoldForTransfer()
    sched, _ = make(cost=RecordingCost(step_s=0.2), hooks=hooks)
    p = request("p", 100, max_tokens=1)

    async def abort_mid_step():
        await asyncio.sleep(0.1)  # the first chunk (0..64) is being computed
        sched.abort("p")

    out = asyncio.run(serve(sched, [p], during=abort_mid_step))
    assert out["p"][-1].finish_reason == "abort"
    assert hooks.computed_ranges == [("p", 0, 64)]  # the step it was in finished first, and said so
    sched.pool.check_integrity()
