"""The load side of the router benchmarks: wrk runs with a JSON result line, and the
processes under test (started, waited for, their CPU counted). Used by router_overhead.py
and router_floors.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROMPT = "Hello there, this is a short prompt for measuring a router."
MAX_TOKENS = 4


# ---- the load: wrk, a request body, its result -------------------------------------------------

def request_body(model: str, stream: bool, max_tokens: int = MAX_TOKENS, prompt: str = PROMPT) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def wrk_script(body: dict) -> str:
    """wrk's Lua: POST `body`; at the end one JSON line with the counts and latency percentiles."""
    lua_body = json.dumps(json.dumps(body))  # a Lua string literal: JSON's escaping is valid Lua
    return f"""wrk.method = "POST"
wrk.body = {lua_body}
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{{"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "mean_us": %.1f, '
    .. '"errors": %d, "non_2xx": %d}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, e.connect + e.read + e.write + e.timeout, e.status))
end
"""


@dataclass(frozen=True)
class LoadResult:
    requests: int
    duration_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    errors: int  # connect, read, write, timeout
    non_2xx: int
    client_cpu_s: float = 0.0  # wrk's own user + system time

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def client_cpu_share(self) -> float:
        """wrk's CPU over wall time: near 1.0 would mean the client, not the proxy, limits."""
        return self.client_cpu_s / self.duration_s if self.duration_s else 0.0


def parse_wrk(stdout: str, client_cpu_s: float = 0.0) -> LoadResult:
    """The JSON line our `done` writes, wherever it is in wrk's output."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{") and '"requests"' in line:
            d = json.loads(line)
            return LoadResult(d["requests"], d["duration_us"] / 1e6, d["p50_us"] / 1e3, d["p90_us"] / 1e3,
                              d["p99_us"] / 1e3, d["mean_us"] / 1e3, d["errors"], d["non_2xx"], client_cpu_s)
    raise ValueError(f"no result line in wrk's output (did the Lua script run?):\n{stdout[-2000:]}")


def run_wrk(url: str, script: Path, connections: int, duration_s: float) -> LoadResult:
    """One wrk run (one thread, keep-alive); its CPU from wait4 (the child's own rusage)."""
    if shutil.which("wrk") is None:
        raise SystemExit("the router benchmarks drive load with wrk, which is not installed: apt-get install wrk")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "10s",
                                 "-s", str(script), url], stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited {proc.returncode}:\n{text[-2000:]}")
    return parse_wrk(text, usage.ru_utime + usage.ru_stime)


# ---- processes and their CPU -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU of these processes and their children so far (vanished ones count 0)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = q.cpu_times()
                total += t.user + t.system
    return total


def wait_http(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before serving {url}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing answered at {url} within {timeout_s:.0f} s")


@dataclass
class Spawned:
    """Processes this benchmark started: each is ended by its own pid at the end."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="router-overhead-")))

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115  (open for the process's lifetime)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
