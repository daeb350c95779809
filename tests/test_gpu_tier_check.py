"""bench/gpu_tier_check.py, the GPU check prepared for a lent device machine, on this machine's CPU:
its round trips hold and it writes what it measured (so a device session runs it as it is)."""

from __future__ import annotations

import json

from pdcluster.bench.gpu_tier_check import main, round_trip


def test_the_checks_hold_on_cpu_and_the_figures_are_written(tmp_path):
    out = tmp_path / "gpu_tier.json"
    assert main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["differs"] == []
    assert {(r["layout"], r["blocks"]) for r in got["bandwidth"]} == {(lay, n) for lay in ("flash_attn", "mla")
                                                                       for n in (1, 8)}
    assert all(r["load_GBps"] > 0 and r["copy_ceiling_GBps"] > 0 for r in got["bandwidth"])


def test_a_block_that_does_not_come_back_is_named(monkeypatch):
    from pdcluster.transfer.host_tier import HostTier

    real = HostTier.load
    monkeypatch.setattr(HostTier, "load", lambda self, keys, ids: real(self, keys[::-1], ids))  # swapped blocks
    assert "flash_attn pin=False layer.0: block 3 -> 40" in round_trip("flash_attn", "cpu", False)
