"""When D sends a stream's tokens (cluster/engine_actor.py StreamPacing): every step by
default, as vLLM's API server; coalesced by token count and/or time when the spec asks."""

from __future__ import annotations

from e2e import cluster_spec_for

from pdcluster.cluster.engine_actor import StreamPacing


def test_the_default_sends_every_steps_tokens():
    spec = cluster_spec_for("pacing")
    assert (spec.router.stream_interval, spec.router.stream_coalesce_ms) == (1, 0.0)
    assert StreamPacing().due(pending=1, since_last_ns=0)


def test_a_token_interval_waits_for_that_many_as_vllms_stream_interval():
    pacing = StreamPacing(tokens=4)
    assert [pacing.due(n, 10**9) for n in (1, 3, 4, 5)] == [False, False, True, True]


def test_a_time_bound_waits_for_the_gap_too():
    pacing = StreamPacing(tokens=1, min_gap_ns=50_000_000)
    assert not pacing.due(8, 49_999_999) and pacing.due(1, 50_000_000)
