"""Traffic control of the lab's links (cluster/lab.py): tc's rate syntax, tbf arguments, and the
qdiscs on each end of a host's veth pair.

A link has two ends (`LinkEnd`): the one on the bridge (root namespace; its egress is what reaches
the host) and the one inside the host's namespace (its egress is what the host sends). Shaping a
link puts tbf on the egress of both, so both directions are limited.

This is the lab's lowest layer: `LabError` and the command runner live here so that lab.py can
import them from it (lab.py re-exports `LabError`).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

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
