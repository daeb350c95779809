"""bench/stream_veth.py's pure parts: arguments, the methods it runs, the table and its goals; the
stripes parallel raw TCP cuts. No root, no lab, no processes."""

from __future__ import annotations

import pytest

from pdcluster.bench import stream_veth as sv
from pdcluster.bench.stream_common import MIB, split, stripes


def test_parse_args_defaults_and_lists():
    a = sv.parse_args([])
    assert a.rates == ["4gbit"] and a.stream_counts == [1, 2] and a.trials == 7
    assert (a.grpc_chunk, a.dist_chunk) == (MIB, 16 * MIB)
    a = sv.parse_args(["--rate", "2gbit,8gbit", "--streams", "4", "--grpc-chunk-mib", "0.5"])
    assert a.rates == ["2gbit", "8gbit"] and a.stream_counts == [1, 4] and a.grpc_chunk == MIB // 2
    with pytest.raises(SystemExit):
        sv.parse_args(["--streams", "0"])


def test_methods_reference_first_and_streams():
    ms = sv.methods(sv.parse_args(["--streams", "1,3"]))
    assert ms[0] == (sv.REF, "raw_tcp", (True, 1))
    labels = [m[0] for m in ms]
    assert len(labels) == len(set(labels))
    assert ("raw TCP, 3 connections", "raw_tcp", (True, 3)) in ms
    pdc = [m for m in ms if m[0].startswith("[pdc]")]
    assert {m[2] for m in pdc} == {(MIB, "grpc", 1), (16 * MIB, "torch_dist", 1), (MIB, "grpc", 3),
                                   (16 * MIB, "torch_dist", 3)}
    # every pull's parts come from sources P holds: one service serves each chunk size
    a = sv.parse_args(["--streams", "1,3", "--trials", "2"])
    per_chunk = sum(m[2][2] for m in pdc if m[2][0] == MIB) * (a.trials + 1)
    assert sv.sources_per_server(a) >= per_chunk


def test_summarize_ratios_and_verdict():
    total = 1_000_000_000
    times = {sv.REF: [1.0, 1.2, 0.9], "[pdc] a": [2.0, 2.0, 2.1], "[pdc] b": [1.05, 1.1, 1.0], "other": [0.5]}
    rows = {r["method"]: r for r in sv.summarize(times, total)}
    assert rows[sv.REF]["ratio"] == 1.0 and rows[sv.REF]["gbs"] == pytest.approx(1.0)
    assert rows[sv.REF]["gbits"] == pytest.approx(8.0)
    assert rows[sv.REF]["min_gbs"] == pytest.approx(1 / 1.2) and rows[sv.REF]["max_gbs"] == pytest.approx(1 / 0.9)
    assert rows["[pdc] a"]["ratio"] == pytest.approx(0.5)
    best, met = sv.verdict(list(rows.values()), 0.9)  # "other" is faster, but not the project's transfer
    assert best["method"] == "[pdc] b" and met
    assert not sv.verdict(list(rows.values()), 0.96)[1]
    text = sv.format_table("unshaped", list(rows.values()), 0.6)
    assert "unshaped: goal >= 60% of raw TCP: met (best: [pdc] b, 95%)" in text


def test_split_and_stripes():
    assert split(10, 3) == [(0, 3), (3, 3), (6, 4)]
    assert split(2, 5) == [(0, 1), (1, 1)] and split(7, 1) == [(0, 7)]
    regions = [memoryview(bytes(range(10))), memoryview(bytes(range(100, 107)))]
    parts = stripes(regions, 2)
    assert [[bytes(v) for v in p] for p in parts] == [[bytes(range(5)), bytes(range(100, 103))],
                                                      [bytes(range(5, 10)), bytes(range(103, 107))]]


def test_needs_root(monkeypatch):
    monkeypatch.setattr(sv.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root"):
        sv.main([])
