"""bench/chaos.py's own logic, without a cluster: which requests a link cut caught, and where a
spec's roles go in a lab."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from e2e import cluster_spec_for

from pdcluster.bench.chaos import Cut, in_lab
from pdcluster.router.timeline import RequestRecord

S = 1_000_000_000


def record(p="prefill-0", d="decode-1", **events) -> RequestRecord:
    return RequestRecord(request_id="r", prefill_instance=p, decode_instance=d, events=dict(events))


# host1 holds prefill-0 and prefill-2, host4 decode-1: the cut separates both pairs.
CUT = Cut(at_s=1.0, hosts=("host1", "host4"), pairs=(("prefill-0", "decode-1"), ("prefill-2", "decode-1")),
          start_ns=10 * S, end_ns=14 * S)


@pytest.mark.parametrize("rec, caught", [
    (record(transfer_start=9 * S, transfer_end=11 * S), True),  # under way when the cut came
    (record(transfer_start=12 * S, transfer_end=20 * S), True),  # began under it
    (record(transfer_start=12 * S, finish=19 * S), True),  # never ended: its finish counts
    (record(transfer_start=5 * S, transfer_end=10 * S), False),  # done as it came
    (record(transfer_start=14 * S, transfer_end=15 * S), False),  # began as it was healed
    (record(p="prefill-2", transfer_start=9 * S, transfer_end=11 * S), True),  # the other P on host1
    (record(p="prefill-1", transfer_start=9 * S, transfer_end=11 * S), False),  # a pair it did not separate
    (record(d="decode-0", transfer_start=9 * S, transfer_end=11 * S), False),
    (record(finish=12 * S), False),  # no transfer (e.g. failed before one)
])
def test_a_cut_catches_the_transfers_of_its_pair_it_overlaps(rec, caught):
    assert CUT.caught(rec) is caught


@dataclass
class FakeHost:
    name: str


@dataclass
class FakeLab:
    hosts: list[FakeHost]
    ray_address: str = "10.213.0.1:6379"


def test_in_lab_puts_p_on_the_first_half_of_the_hosts_and_d_on_the_rest():
    spec = in_lab(cluster_spec_for("x", 2, 2), FakeLab([FakeHost(f"host{k}") for k in range(1, 6)]))
    assert spec.ray_address == "10.213.0.1:6379"
    assert spec.prefill.placement.labels == {"pdc-host": "in(host1,host2)"} and spec.prefill.placement.spread
    assert spec.decode.placement.labels == {"pdc-host": "in(host3,host4,host5)"} and spec.decode.placement.spread


def test_in_lab_needs_two_hosts():
    with pytest.raises(AssertionError, match="1 hosts"):
        in_lab(cluster_spec_for("x"), FakeLab([FakeHost("host1")]))
