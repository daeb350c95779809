"""`pdc lab ...`: the multi-host lab (cluster/lab.py) from the command line.

`add_lab_commands(subparsers)` adds `pdc lab up|status|down|exec|link|kill|revive|partition|heal` to an existing
`pdc` parser; each sets `fn`, which the caller runs as `args.fn(args)`. A lab error is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

from pdcluster.cluster.lab import LABEL_KEY, Lab, LabError
from pdcluster.cluster.lab_state import check_lab_name


def _guarded(fn: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], None]:
    def run(a: argparse.Namespace) -> None:
        try:
            code = fn(a)
        except LabError as err:
            print(f"pdc lab: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        if code:
            raise SystemExit(code)

    return run


def _print_hosts(lab: Lab) -> None:
    print(f"  {'head':<8} {lab.head_address:<15} label {LABEL_KEY}=head   (root namespace, bridge {lab.bridge})")
    for h in lab.hosts:
        shaping = f"  tbf {h.rate} latency {h.latency}" if h.rate else ""
        print(f"  {h.name:<8} {h.address:<15} label {LABEL_KEY}={h.label:<6} (netns {h.netns}){shaping}")
    if lab.partitions:
        print("partitions: " + ", ".join(f"{a} <-> {b}" for a, b in lab.partitions))
    print(f"ray_address: {lab.ray_address}  ({lab.failure_detection.describe()})")


def _up(a: argparse.Namespace) -> None:
    t0 = time.monotonic()
    if not 0 < a.partition_tolerance <= 3600:
        raise LabError(f"--partition-tolerance {a.partition_tolerance:g}: between 0 and 3600 s")
    lab = Lab.up(hosts=a.hosts, name=a.name, subnet=a.subnet, rate=a.rate, latency=a.latency,
                 partition_tolerance_s=a.partition_tolerance)
    print(f"lab {lab.name!r} up in {time.monotonic() - t0:.1f} s: {len(lab.hosts)} hosts on {lab.subnet}")
    _print_hosts(lab)
    print(f"put `ray_address: {lab.ray_address}` in a spec, pin roles with the label {LABEL_KEY}=hostK; "
          f"pdc lab down --name {lab.name}")


def _status(a: argparse.Namespace) -> None:
    lab = Lab.attach(a.name)
    print(f"lab {lab.name!r}: {len(lab.hosts)} hosts on {lab.subnet}, state {lab.state_dir}")
    _print_hosts(lab)
    try:
        nodes = lab.ray_nodes()
    except Exception as err:  # the head is gone: say so, and still show the hosts
        print(f"ray: not answering ({err})")
        nodes = []
    for label, address, dev, pids, mb in [("head", lab.head_address, lab.bridge, lab.head_pids(), lab.rss_mb(None))] + [
            (h.label, h.address, h.veth, lab.host_pids(h), lab.rss_mb(h)) for h in lab.hosts]:
        alive = [n for n in nodes if n.label == label and n.alive]
        state = f"ray node {alive[0].node_id[:12]} alive" if alive else "no live ray node"
        link = subprocess.run(["ip", "-br", "link", "show", "dev", dev], capture_output=True, text=True).stdout.split()
        print(f"  {label:<8} {address:<15} link {(link[1:2] or ['gone'])[0]:<5} {state:<32} "
              f"{len(pids)} processes, {mb:.0f} MB RSS")


def _down(a: argparse.Namespace) -> None:
    t0 = time.monotonic()
    check_lab_name(a.name)  # a name no lab can have is a typo, not "nothing to do"
    found = Lab.down_by_name(a.name)
    print(f"lab {a.name!r} down in {time.monotonic() - t0:.1f} s" if found else f"no lab {a.name!r} (nothing to do)")


def _exec(a: argparse.Namespace) -> int:
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        raise LabError("no command: pdc lab exec HOST -- CMD ...")
    return Lab.attach(a.name).exec(a.host, cmd).wait()


def _link(a: argparse.Namespace) -> None:
    Lab.attach(a.name).set_link(a.host, a.state == "up")
    print(f"{a.host}: link {a.state}")


def _kill(a: argparse.Namespace) -> None:
    Lab.attach(a.name).kill_host(a.host)
    print(f"{a.host}: link down, every process in its namespace killed")


def _revive(a: argparse.Namespace) -> None:
    Lab.attach(a.name).revive_host(a.host)
    print(f"{a.host}: link up, a new Ray node joined")


def _partition(a: argparse.Namespace) -> None:
    t0 = time.monotonic()
    lab = Lab.attach(a.name)
    (lab.partition if a.lab_cmd == "partition" else lab.heal)(a.a, a.b)
    what = "cut (both ways; each still reaches the head and the other hosts)" if a.lab_cmd == "partition" else "healed"
    print(f"{lab.host(a.a).name} <-> {lab.host(a.b).name}: {what} in {(time.monotonic() - t0) * 1e3:.0f} ms")


def add_lab_commands(sub: argparse._SubParsersAction) -> None:
    lab = sub.add_parser("lab", help="one machine rehearsing N hosts (network namespaces, a Ray node each)")
    cmds = lab.add_subparsers(dest="lab_cmd", required=True)

    def add(name: str, fn: Callable, help_: str) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help_)
        p.add_argument("--name", default="pdclab", help="lab name (default pdclab)")
        p.set_defaults(fn=_guarded(fn))
        return p

    up = add("up", _up, "make the hosts and start Ray on each; prints the ray_address for a spec")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--subnet", default="10.213.0.0/24")
    up.add_argument("--rate", default=None, help="tbf rate of each host's link, both directions (e.g. 200mbit)")
    up.add_argument("--latency", default=None, help="tbf latency: how long a packet may queue (default 50ms)")
    up.add_argument("--partition-tolerance", type=float, default=30.0, metavar="S",
                    help="a host unreachable for less keeps its Ray node and instances (default 30)")
    add("status", _status, "hosts, links, Ray nodes, memory")
    add("down", _down, "remove everything the lab made (idempotent)")
    ex = add("exec", _exec, "run a command inside a host's namespace (VLLM_HOST_IP set)")
    ex.add_argument("host")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    link = add("link", _link, "set a host's link up or down (down: packets vanish, no FIN/RST)")
    link.add_argument("host")
    link.add_argument("state", choices=["up", "down"])
    add("kill", _kill, "crash a host: link down, then SIGKILL every process in it").add_argument("host")
    add("revive", _revive, "link up and a new Ray node with the same label").add_argument("host")
    for name, help_ in (("partition", "cut the path between hosts A and B silently, both ways, and only it"),
                        ("heal", "lift the partition between hosts A and B")):
        p = add(name, _partition, help_)
        p.add_argument("a", metavar="A")
        p.add_argument("b", metavar="B")


if __name__ == "__main__":  # python -m pdcluster.cluster.lab_cli lab up ...
    ap = argparse.ArgumentParser(prog="pdc")
    add_lab_commands(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args()
    args.fn(args)
