"""P -> D KV transfer over a torch.distributed data channel (gloo here; transfer/dist_channel.py):
D asks over gRPC, the blocks move on the pair. Fakes in tests/transfer_fakes.py."""

from __future__ import annotations

import socket

import pytest
import torch
from transfer_fakes import (
    BLOCK_SIZE,
    LAYERS,
    block,
    make_job,
    offer,
    released,
    wait_results,
    wait_until_true,
)


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_gloo_channel_moves_the_planned_blocks_exactly(gloo_pair, layout):
    block_bytes = 2 * 16 * 32 * 4 if layout == "cpu" else 2 * 8 * 4 * 4
    p, d = gloo_pair(layout, chunk_bytes=2 * block_bytes)  # several chunks per layer
    table = (2, 5, 7, 9, 10)
    for tid in ("r1", "r2"):
        offer(p, tid, table)
    # r1 into scattered D blocks (staged), r2 into consecutive ones (straight into the cache).
    for tid, local in (("r1", (0, 15, 4, 3, 8)), ("r2", (10, 11, 12, 13, 14))):
        d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3, 4), local, transfer_id=tid, num_blocks=5,
                                  transport="torch_dist"))
        r = wait_results(d.fetcher, {f"d-{tid}"}, timeout=15)
        assert r.finished == {f"d-{tid}"} and r.failed == set(), r
        for name in LAYERS:
            for pb_id, lb in zip(table, local):
                assert torch.equal(block(d.caches[name], d.block_dim, lb), block(p.caches[name], p.block_dim, pb_id))
    assert p.sources.take_finished() == {"r1", "r2"}


def test_gloo_channel_transfer_broken_halfway_fails_then_the_next_one_works(gloo_pair):
    p, d = gloo_pair(break_prefix="break-")
    offer(p, "break-1", (2, 5, 7, 9))
    offer(p, "ok-1", (2, 5, 7, 9))
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (0, 1, 2, 3), transfer_id="break-1",
                              transport="torch_dist"))
    r = wait_results(d.fetcher, {"d-break-1"}, timeout=15)
    assert r.failed == {"d-break-1"}
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (4, 5, 6, 7), transfer_id="ok-1",
                              transport="torch_dist"))
    r = wait_results(d.fetcher, {"d-ok-1"}, timeout=15)
    assert r.finished == {"d-ok-1"} and r.failed == set()
    assert torch.equal(d.caches[LAYERS[1]][7], p.caches[LAYERS[1]][9])
    assert released(p.sources, {"break-1", "ok-1"}) == {"break-1", "ok-1"}


def test_a_channel_only_p_saw_die_is_replaced_and_the_transfer_goes_through(gloo_pair):
    """E.g. a cut link: P's keepalive declared the pair dead, D's had not yet. D's next transfer
    must not fail on the stale pair: P says so before sending anything, and D retries on a new one."""
    p, d = gloo_pair()
    for tid in ("r1", "r2"):
        offer(p, tid, (2, 5, 7, 9))
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (0, 1, 2, 3), transfer_id="r1", transport="torch_dist"))
    assert wait_results(d.fetcher, {"d-r1"}, timeout=15).failed == set()
    host = p.server._channels
    [name] = host.opened()
    p_end = host.get(name)
    p_end._alive.shutdown(socket.SHUT_RD)  # P's watcher sees its peer leave; nothing reaches D
    wait_until_true(lambda: p_end.unusable is not None)
    [d_end] = d.fetcher._channels._channels.values()
    assert d_end.unusable is None
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (4, 5, 6, 7), transfer_id="r2", transport="torch_dist"))
    r = wait_results(d.fetcher, {"d-r2"}, timeout=15)
    assert r.finished == {"d-r2"} and r.failed == set(), r
    for name_ in LAYERS:
        for pb_id, lb in zip((2, 5, 7, 9), (4, 5, 6, 7)):
            assert torch.equal(d.caches[name_][lb], p.caches[name_][pb_id])
    [new_name] = host.opened()
    assert new_name != name


def test_gloo_channel_push_streams_as_layers_become_ready(gloo_pair):
    p, d = gloo_pair()
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (3, 2, 1, 0), transport="torch_dist"))
    wait_until_true(lambda: p.sources.waiting == 1)  # D asked before P ran the request
    p.sources.step("r1", "r1", 4 * BLOCK_SIZE, ((2, 5, 7),), 3 * BLOCK_SIZE)
    p.sources.layer_done(LAYERS[0])
    p.sources.step_done()
    p.sources.step("r1", "r1", 4 * BLOCK_SIZE, ((2, 5, 7, 9),), 4 * BLOCK_SIZE)
    p.sources.step_done()
    p.sources.finish("r1", 60)
    r = wait_results(d.fetcher, {"d-r1"}, timeout=15)
    assert r.finished == {"d-r1"} and r.failed == set()
    for name in LAYERS:
        for pb_id, lb in zip((2, 5, 7, 9), (3, 2, 1, 0)):
            assert torch.equal(d.caches[name][lb], p.caches[name][pb_id])


def test_on_a_backend_that_matches_by_posting_order_concurrent_transfers_take_turns(gloo_pair, monkeypatch):
    """NCCL and HCCL ignore tags: two transfers at once on one pair would pair one request's sends
    with the other's receives. Gloo told to behave so (tag 0 on the wire, as they do): each
    request's blocks must land where that request planned them, whatever the interleaving."""
    from pdcluster.transfer import dist_channel

    monkeypatch.setattr(dist_channel, "TAGGED_BACKENDS", ())
    p, d = gloo_pair(chunk_bytes=2 * 16 * 32 * 4)  # one block per chunk: many posts to interleave
    tables = {f"r{i}": tuple(range(1 + i, 12, 2))[:4] for i in range(4)}
    for tid, table in tables.items():
        offer(p, tid, table)
    locals_ = {f"r{i}": tuple(range(4 * i, 4 * i + 4)) for i in range(4)}
    for tid in tables:
        d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), locals_[tid], transfer_id=tid, transport="torch_dist"))
    r = wait_results(d.fetcher, {f"d-{t}" for t in tables}, timeout=30)
    assert r.finished == {f"d-{t}" for t in tables} and r.failed == set(), r
    for tid, table in tables.items():
        for name in LAYERS:
            for pb_id, lb in zip(table, locals_[tid]):
                assert torch.equal(d.caches[name][lb], p.caches[name][pb_id]), (tid, name, pb_id, lb)
