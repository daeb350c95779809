"""Traffic control of the lab's links (cluster/lab.py): tc's rate syntax, tbf arguments, and the
qdiscs on each end of a host's veth pair.

A link has two ends (`LinkEnd`): the one on the bridge (root namespace; its egress is what reaches
the host, from the head or from any other host) and the one inside the host's namespace (its egress
is what the host sends). Shaping a link limits the egress of both, so both directions are limited:
a plain tbf inside (`set_tbf`), and on the bridge end a tbf inside the tree below.

The bridge end's egress tree (`egress_commands`), there only while the link is shaped or cut from
some host (otherwise the link has no qdisc at all, as a fresh veth):

    htb 1: root, default class 1:10
    ├── class 1:10   everything not filtered   -> tbf 10: while shaped
    └── class 1:20   the black hole            -> pfifo 20: limit 0 (drops all it is given)
    u32 filters, prio 1, handle 800::K: ip src = host K's address -> 1:20

So a partition between hosts a and b drops, on the bridge, every IPv4 packet a sends to b and b
sends to a, and nothing else: a broken path in the switch, invisible to both hosts' stacks. (ARP
still passes, so neither host's neighbour entry fails: connects time out rather than turning into
"no route to host"; IPv6 link-local traffic passes too, which nothing in the lab uses.) Dropping
on the sender's own egress instead, inside its namespace, is not silent: the sender's TCP sees a
local drop (treated as local congestion, retried by its probe timer every ~0.5 s) and aborts the
connection with ETIMEDOUT after ~8 s (tcp_retries2 = 15 probes); a UDP socket with IP_RECVERR gets
ENOBUFS. Both measured on this kernel, which has no act_gact either (no `action drop` on ingress).

`LinkControl` holds Lab's methods for all this (Lab inherits them). This is the lab's lowest layer:
`LabError` and the command runner live here so that lab.py can import them from it (lab.py
re-exports `LabError`).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.cluster.lab import Host, LabHost

DEFAULT_LATENCY = "50ms"  # tbf's queue bound when only a rate is given


class LabError(RuntimeError):
    """The lab cannot be made or used as asked; the message says why and what to run."""


def run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; with `check`, LabError carrying its stderr when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {(out.stderr or out.stdout).strip()}")
    return out


_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(i?)(bit|bps)?", re.IGNORECASE)
_TIME = re.compile(r"\d+(?:\.\d+)?(?:s|sec|ms|msec|us|usec)?")


def rate_bits(rate: str) -> float:
    """tc's rate syntax in bits per second: "200mbit", "1gbit", "10mbps" (bytes), "1mibit"."""
    m = _RATE.fullmatch(rate.strip())
    if not m:
        raise LabError(f"rate {rate!r}: expected a tc rate such as 200mbit or 1gbit")
    value, prefix, binary, unit = m.groups()
    scale = (1024 if binary else 1000) ** " kmgt".index(prefix.lower() or " ")
    return float(value) * scale * (8 if (unit or "bit").lower() == "bps" else 1)


def tbf_args(rate: str, latency: str | None) -> list[str]:
    """`tc qdisc replace ... root` arguments shaping to `rate`. The burst is 4 ms of the rate and at
    least 32 KiB, so that a full-size frame always fits (tbf drops what exceeds it)."""
    latency = latency or DEFAULT_LATENCY
    if not _TIME.fullmatch(latency):
        raise LabError(f"latency {latency!r}: expected a tc time such as 50ms")
    burst = max(32 * 1024, int(rate_bits(rate) / 8 * 0.004))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", latency]


@dataclass(frozen=True)
class LinkEnd:
    """One end of a host's veth pair: `dev` in namespace `netns` (None: the root namespace)."""

    netns: str | None
    dev: str

    def tc(self, *args: str) -> list[str]:
        """The argv of `tc ARGS` run against this end's namespace."""
        return ["tc", *(["-n", self.netns] if self.netns else []), *args]


def set_tbf(end: LinkEnd, rate: str | None, latency: str | None) -> None:
    """tbf on the egress of `end` shaping to `rate`; rate None removes it (none there: fine)."""
    if rate is None:
        run(end.tc("qdisc", "del", "dev", end.dev, "root"), check=False)
    else:
        run(end.tc("qdisc", "replace", "dev", end.dev, "root", *tbf_args(rate, latency)))


# ---- the bridge end's tree: shaping and partitions ----

PARTITION_PRIO = "1"  # every partition filter at one prio: u32 ties a handle's table to its prio
MAX_FILTER_NODE = 0xFFF  # a u32 handle's node part is 12 bits: the partner host's index must fit
# The default class must never be what limits (its tbf child shapes): a rate veth never reaches here
# (it does 11-15 Gbit/s), an explicit burst (tc's own at such a rate shows as 0) and quantum (tc warns
# that the one it computes is too big).
_PASS_ALL = ["htb", "rate", "100gbit", "burst", "1mb", "cburst", "1mb", "quantum", "60000"]


@dataclass(frozen=True)
class Egress:
    """What the egress of a link's bridge end does: shape to `rate` (None: not shaped) and drop
    every IPv4 packet whose source is one of `drop_from`'s addresses (index K -> filter 800::K)."""

    rate: str | None = None
    latency: str | None = None
    drop_from: dict[int, str] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """Nothing to do: the end then has no qdisc of ours at all."""
        return self.rate is None and not self.drop_from


def egress_commands(end: LinkEnd, have: Egress, want: Egress) -> list[list[str]]:
    """The tc commands taking `end` from `have` to `want`, in order. Only what differs is touched:
    reshaping never lifts a partition even for a moment, and adding or lifting one partition leaves
    the others and the shaping alone. Packets queued are dropped only when the whole tree goes."""
    for k in want.drop_from:
        if not 1 <= k <= MAX_FILTER_NODE:
            raise LabError(f"host index {k}: a partition filter's handle holds 1..{MAX_FILTER_NODE}")
    dev = ["dev", end.dev]
    if want.plain:
        return [] if have.plain else [end.tc("qdisc", "del", *dev, "root")]
    cmds = []
    if have.plain:  # build the tree; `replace`: a plain tbf root of an older lab version goes too
        have = Egress()
        cmds += [end.tc("qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "10"),
                 end.tc("class", "replace", *dev, "parent", "1:", "classid", "1:10", *_PASS_ALL),
                 end.tc("class", "replace", *dev, "parent", "1:", "classid", "1:20", *_PASS_ALL),
                 end.tc("qdisc", "replace", *dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")]
    if want.rate is not None and (want.rate, want.latency) != (have.rate, have.latency):
        cmds.append(end.tc("qdisc", "replace", *dev, "parent", "1:10", "handle", "10:",
                           *tbf_args(want.rate, want.latency)))
    elif want.rate is None and have.rate is not None:
        cmds.append(end.tc("qdisc", "del", *dev, "parent", "1:10", "handle", "10:"))  # class 1:10 still passes
    filt = ["filter", "replace", *dev, "parent", "1:", "protocol", "ip", "prio", PARTITION_PRIO]
    for k, address in sorted(want.drop_from.items()):
        if have.drop_from.get(k) != address:
            cmds.append(end.tc(*filt, "handle", f"800::{k:x}", "u32", "match", "ip", "src", f"{address}/32",
                               "flowid", "1:20"))
    for k in sorted(have.drop_from.keys() - want.drop_from.keys()):
        cmds.append(end.tc("filter", "del", *dev, "parent", "1:", "protocol", "ip", "prio", PARTITION_PRIO,
                           "handle", f"800::{k:x}", "u32"))
    return cmds


def apply(cmds: list[list[str]]) -> None:
    """Run `cmds` in order; LabError at the first that fails (the ones before it stay applied)."""
    for argv in cmds:
        run(argv)


class LinkControl:
    """Lab's shaping and partitions (cluster/lab.py's Lab inherits them). The state file is the
    record of what the links have: each change first reads it (another Lab object, in this process
    or in `pdc lab partition`, may have changed them), applies only the difference to the links,
    then records it in the hosts' `rate`, `latency`, `partitioned_from` and saves."""

    if TYPE_CHECKING:  # what Lab provides
        name: str
        hosts: list[LabHost]

        @classmethod
        def attach(cls, name: str) -> LinkControl: ...

        def host(self, host: Host) -> LabHost: ...

        def _save(self) -> None: ...

    def shape(self, host: Host | None, rate: str | None, latency: str | None = None) -> None:
        """tbf on the egress of both ends of a host's link (None: every host's); rate None unshapes.
        Partitions stay as they are, cut all along."""
        self._refresh()
        for h in self.hosts if host is None else [self.host(host)]:
            have = self._bridge_egress(h)
            want = dataclasses.replace(have, rate=rate, latency=(latency or DEFAULT_LATENCY) if rate else None)
            apply(egress_commands(LinkEnd(None, h.veth), have, want))
            set_tbf(LinkEnd(h.netns, h.peer), rate, latency)
            h.rate, h.latency = want.rate, want.latency
        self._save()

    def partition(self, a: Host, b: Host) -> None:
        """Cut the path between hosts a and b, both ways, and only it: each still reaches the head
        and the other hosts. Dropped on the bridge, so neither host's stack knows (no FIN, RST, ICMP
        or local error: a connect times out, sent data waits and is retransmitted with TCP's usual
        backoff). Shaping stays as it is. Idempotent."""
        self._set_partition(a, b, cut=True)

    def heal(self, a: Host, b: Host) -> None:
        """Lift the partition between a and b, if any (other partitions and shaping stay): a
        connection whose ends kept their sockets resumes at its next retransmission."""
        self._set_partition(a, b, cut=False)

    @property
    def partitions(self) -> list[tuple[str, str]]:
        """The partitions, as (host, host) by names, the lower index first: as this object last read
        or made them (`Lab.attach(name).partitions`: as they are now)."""
        return [(h.name, n) for h in self.hosts for n in h.partitioned_from if self.host(n).index > h.index]

    def _refresh(self) -> None:
        saved = {h.name: h for h in self.attach(self.name).hosts}
        for h in self.hosts:
            h.rate, h.latency, h.partitioned_from = saved[h.name].rate, saved[h.name].latency, saved[h.name].partitioned_from

    def _bridge_egress(self, h: LabHost, cut_from: list[str] | None = None) -> Egress:
        peers = map(self.host, h.partitioned_from if cut_from is None else cut_from)
        return Egress(rate=h.rate, latency=h.latency, drop_from={p.index: p.address for p in peers})

    def _set_partition(self, a: Host, b: Host, cut: bool) -> None:
        pair = self.host(a), self.host(b)
        self._refresh()
        if pair[0] is pair[1]:
            raise LabError(f"a partition is between two hosts, not {pair[0].name} and itself")
        for x, y in (pair, pair[::-1]):  # x's link drops what y sends it: both ways cut
            names = [n for n in x.partitioned_from if n != y.name] + ([y.name] if cut else [])
            if set(names) != set(x.partitioned_from):
                apply(egress_commands(LinkEnd(None, x.veth), self._bridge_egress(x), self._bridge_egress(x, names)))
                x.partitioned_from = sorted(names, key=lambda n: self.host(n).index)
                self._save()  # at once: the other end may yet fail
