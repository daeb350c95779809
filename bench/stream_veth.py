"""State streaming across a real link: stream_throughput.py with P and D on two hosts of the lab.

A 128K-token request's blocks (the tiny Qwen3, as stream_throughput.py) move from a P process in
the lab's host1 to a D process in host2 (cluster/lab.py: network namespaces on a bridge, each its
own address), across their veths and the bridge, by raw TCP (the reference), the project's gRPC
transport (KvServer/KvFetcher) and its torch_dist transport (gloo through KvServer), and the gloo
channel alone; optionally several at once (N raw TCP connections, N pulls of a part each through
the fetcher's threads). Methods interleaved, each the median of --trials, every ratio to raw TCP
over one connection in the same phase. Phases: unshaped, then each --rate (lab.shape: tbf on both
ends of every host's link), each with fresh P and D processes. P is pinned to core 0, D to core 1.

Needs root (the lab makes namespaces, veths and qdiscs). Lab "pdcbench" on 10.213.90.0/24, always
taken down at the end.

usage: sudo .venv/bin/python -m pdcluster.bench.stream_veth [--rate 4gbit] [--trials 7] [--streams 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import statistics
import subprocess
import sys
import time

from pdcluster.bench.stream_common import MIB, _exit_now, tiny_shape
from pdcluster.bench.stream_throughput import Bench, _p_main

LAB_NAME = "pdcbench"
LAB_SUBNET = "10.213.90.0/24"
GOALS = {"shaped": 0.90, "unshaped": 0.60}  # the project's transfer against raw TCP (issue 14, item 6)
REF = "raw TCP, 1 connection (the reference)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--rate", default="4gbit", help="the shaped phases' rates, comma-separated (tbf: 2gbit, 500mbit)")
    ap.add_argument("--streams", default="1,2", help="parallel streams to try, comma-separated (1 is always run)")
    ap.add_argument("--grpc-chunk-mib", type=float, default=1.0, help="gRPC transport's chunks (its default: 1)")
    ap.add_argument("--dist-chunk-mib", type=float, default=16.0, help="torch_dist's channel chunks (default: 16)")
    ap.add_argument("--no-unshaped", action="store_true", help="only the shaped phases")
    # internal: the P and D processes the bench starts inside the lab's hosts
    ap.add_argument("--role", choices=["p", "d"], help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)  # P's address (both roles)
    ap.add_argument("--p", help=argparse.SUPPRESS)  # D: P's ports, as P printed them
    a = ap.parse_args(argv)
    a.rates = [r for r in a.rate.split(",") if r] if a.rate else []
    a.stream_counts = sorted({1, *(int(n) for n in a.streams.split(",") if n)})
    if min(a.stream_counts) < 1:
        ap.error("--streams: counts must be >= 1")
    a.grpc_chunk, a.dist_chunk = int(a.grpc_chunk_mib * MIB), int(a.dist_chunk_mib * MIB)
    return a


def methods(a: argparse.Namespace) -> list[tuple[str, str, tuple]]:
    """(label, Bench method name, its args); the reference first, the project's transfers marked [pdc]."""
    g, d = a.grpc_chunk, a.dist_chunk
    out = [(REF, "raw_tcp", (True, 1))]
    out += [(f"raw TCP, {n} connections", "raw_tcp", (True, n)) for n in a.stream_counts if n > 1]
    for n in a.stream_counts:
        each = "" if n == 1 else f", {n} pulls at once"
        out.append((f"[pdc] gRPC KvServer/KvFetcher, {g / MIB:g} MiB chunks{each}", "grpc_pull", (g, "grpc", n)))
        if n == 1:
            out.append((f"gRPC sealed (transfer.encrypt), {g / MIB:g} MiB chunks", "grpc_pull", (g, "grpc", 1, True)))
        out.append((f"[pdc] torch_dist (gloo) via KvServer, {d / MIB:g} MiB{each}", "grpc_pull", (d, "torch_dist", n)))
    out.append((f"gloo channel alone, {d / MIB:g} MiB chunks", "gloo", (d,)))
    return out


def sources_per_server(a: argparse.Namespace) -> int:
    """Each pull of N parts takes N of a KV service's sources; both services get this many (ample)."""
    return 2 * (a.trials + 2) * sum(a.stream_counts)


def summarize(times: dict[str, list[float]], total_bytes: int) -> list[dict]:
    """One row per method: median seconds, GB/s and Gbit/s at the median, the spread, the ratio to REF."""
    ref = statistics.median(times[REF])
    rows = []
    for label, ts in times.items():
        med = statistics.median(ts)
        rows.append({"method": label, "median_ms": med * 1e3, "gbs": total_bytes / med / 1e9,
                     "gbits": total_bytes * 8 / med / 1e9, "min_gbs": total_bytes / max(ts) / 1e9,
                     "max_gbs": total_bytes / min(ts) / 1e9, "ratio": ref / med})
    return rows


def verdict(rows: list[dict], goal: float) -> tuple[dict, bool]:
    """The project's best transfer (a [pdc] row) and whether it reaches `goal` of raw TCP."""
    best = max((r for r in rows if r["method"].startswith("[pdc]")), key=lambda r: r["ratio"])
    return best, best["ratio"] >= goal


def format_table(phase: str, rows: list[dict], goal: float) -> str:
    lines = [f"{'method':<60} {'median ms':>9} {'GB/s':>6} {'Gbit/s':>6} {'vs raw TCP':>10}  (min-max GB/s)"]
    for r in rows:
        lines.append(f"{r['method']:<60} {r['median_ms']:>9.1f} {r['gbs']:>6.2f} {r['gbits']:>6.2f} "
                     f"{r['ratio']:>9.0%}  ({r['min_gbs']:.2f}-{r['max_gbs']:.2f})")
    best, met = verdict(rows, goal)
    lines.append(f"{phase}: goal >= {goal:.0%} of raw TCP: {'met' if met else 'NOT met'} "
                 f"(best: {best['method']}, {best['ratio']:.0%})")
    return "\n".join(lines)


# ---------------------------------------------------------------- P and D, inside the lab's hosts


class _PrintReady:
    def put(self, ports: dict) -> None:  # _p_main's addresses, to the bench on stdout
        print(json.dumps(ports), flush=True)


def _role_p(a: argparse.Namespace) -> None:
    shape = tiny_shape(a.tokens)
    _p_main(shape, sorted({a.grpc_chunk, a.dist_chunk}), sources_per_server(a), 0, _PrintReady(), a.host,
            streams=max(a.stream_counts))


def _role_d(a: argparse.Namespace) -> None:
    shape = tiny_shape(a.tokens)
    b = Bench(shape, sorted({a.grpc_chunk, a.dist_chunk}), a.trials, True, host=a.host, p=json.loads(a.p),
              streams=max(a.stream_counts))
    ms = [(label, getattr(b, name), args) for label, name, args in methods(a)]
    try:
        for label, fn, args in ms:  # each method once, untimed, into a zeroed cache: every block compared
            b.check(fn, *args)
        times: dict[str, list[float]] = {label: [] for label, _, _ in ms}
        for _ in range(a.trials):
            for label, fn, args in ms:
                times[label].append(fn(*args))
    finally:
        b.close()
    print(json.dumps(times), flush=True)
    _exit_now()


# ---------------------------------------------------------------- the bench, in the root namespace


def _read_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line:
                return line
            break
        if proc.poll() is not None:
            break
    raise RuntimeError(f"{what} gave no result (exit code {proc.poll()}; its stderr is above)")


def run_phase(lab, a: argparse.Namespace, argv: list[str]) -> dict[str, list[float]]:
    """Fresh P on host1 and D on host2; D's times per method."""
    p_host = lab.host("host1").address
    base = [sys.executable, "-m", "pdcluster.bench.stream_veth", *argv, "--host", p_host]
    procs = [lab.exec("host1", [*base, "--role", "p"], stdout=subprocess.PIPE, text=True)]
    try:
        ports = _read_line(procs[0], 180, "P on host1")
        procs.append(lab.exec("host2", [*base, "--role", "d", "--p", ports.strip()], stdout=subprocess.PIPE,
                              text=True))
        times = json.loads(_read_line(procs[1], 1800, "D on host2"))
        procs[0].wait(timeout=60)
        return times
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.role == "p":
        return _role_p(a)
    if a.role == "d":
        return _role_d(a)
    if os.geteuid() != 0:
        sys.exit("stream_veth needs root: it runs P and D in the multi-host lab (network namespaces, veths, tc). "
                 "Run it as root, e.g. sudo .venv/bin/python -m pdcluster.bench.stream_veth; "
                 "stream_throughput.py is the same bench on loopback, without root.")
    from pdcluster.cluster.lab import Lab

    os.environ["PDC_CLUSTER_SECRET"] = secrets.token_hex(32)  # P's KV services and D's fetcher share it
    shape = tiny_shape(a.tokens)
    phases = ([] if a.no_unshaped else [None]) + a.rates
    print(f"{a.tokens} tokens of the tiny Qwen3: {shape.layers} layers x {shape.num_blocks} blocks "
          f"= {shape.total_bytes / MIB:.0f} MiB, lab host1 (P, core 0) -> host2 (D, core 1) across the veth; "
          f"{a.trials} trials; phases: {', '.join(r or 'unshaped' for r in phases)}", flush=True)
    lab = Lab.up(hosts=2, name=LAB_NAME, subnet=LAB_SUBNET)
    try:
        for rate in phases:
            lab.shape(None, rate)
            t0 = time.monotonic()
            times = run_phase(lab, a, argv)
            name = f"shaped to {rate}" if rate else "unshaped"
            print(f"\n{name} ({time.monotonic() - t0:.0f} s)")
            print(format_table(name, summarize(times, shape.total_bytes), GOALS["shaped" if rate else "unshaped"]),
                  flush=True)
    finally:
        lab.down()


if __name__ == "__main__":
    main()
