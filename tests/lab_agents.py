"""Agents in the lab's hosts for tests/test_lab_e2e.py: a small Python process per host (and the
head) that listens, connects, streams and counts on command, so that a test sees the lab's links
as an application would. The `agents` fixture (conftest.py) starts one per host."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdcluster.cluster.lab import Lab

AGENT = r"""
import fcntl, select, socket, struct, sys, termios, threading, time
got, udp_got, state, w = [0], [0], ["none"], None  # bytes in on accepted connections; the last with data:
def out(*a): print(*a, flush=True)
def read(c):  # open, eof or error (connections that carry no data, as `connect`'s, do not count)
    n, end = 0, "eof"
    try:
        while d := c.recv(1 << 20):
            n, got[0], state[0] = n + len(d), got[0] + len(d), "open"
    except OSError as err: end = f"error {err.errno}"
    if n: state[0] = end
def serve(srv):
    while True: threading.Thread(target=read, args=(srv.accept()[0],), daemon=True).start()
def count(u):
    while u.recv(65536): udp_got[0] += 1
while line := sys.stdin.readline():
    cmd, *a = line.split()
    try:
        if cmd == "listen":  # ADDR: TCP and UDP on one port, counting what comes in
            srv = socket.create_server((a[0], 0)); u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind((a[0], srv.getsockname()[1])); out(srv.getsockname()[1])
            threading.Thread(target=serve, args=(srv,), daemon=True).start()
            threading.Thread(target=count, args=(u,), daemon=True).start()
        elif cmd == "connect":  # ADDR PORT TIMEOUT
            socket.create_connection((a[0], int(a[1])), timeout=float(a[2])).close(); out("ok")
        elif cmd == "open":  # ADDR PORT: the connection `send` writes to
            w = socket.create_connection((a[0], int(a[1])), timeout=5); w.setblocking(False); out("ok")
        elif cmd == "send":  # N SECONDS: how much of N bytes the kernel took within SECONDS
            n, end, sent, buf = int(a[0]), time.monotonic() + float(a[1]), 0, bytes(1 << 16)
            while sent < n and time.monotonic() < end:
                try: sent += w.send(buf[:n - sent])
                except BlockingIOError: select.select([], [w], [], 0.05)
            out(sent)
        elif cmd == "state":  # the writer's bytes not yet acked, and its pending error
            out(struct.unpack("i", fcntl.ioctl(w, termios.TIOCOUTQ, bytes(4)))[0], w.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        elif cmd == "received": out(got[0], state[0])
        elif cmd == "udp":  # ADDR PORT N: send N datagrams; with IP_RECVERR a local drop would raise ENOBUFS
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.IPPROTO_IP, 11, 1)
            for _ in range(int(a[2])): s.sendto(b"x", (a[0], int(a[1])))
            time.sleep(0.1); out("sent", s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        elif cmd == "udp_received": out(udp_got[0])
    except TimeoutError: out("timeout")
    except OSError as err: out("error", err.errno, err.strerror)
"""


class Agent:
    """AGENT in a host's namespace, or in the root one for "head": one command line in, one line out."""

    def __init__(self, lab: Lab, where: str):
        argv, kw = [sys.executable, "-c", AGENT], {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        self.proc = subprocess.Popen(argv, **kw) if where == "head" else lab.exec(where, argv, **kw)
        self.address = lab.head_address if where == "head" else lab.host(where).address
        self.port = int(self.ask(f"listen {self.address}"))

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def reply(self) -> str:
        line = self.proc.stdout.readline()
        assert line, "the agent died"
        return line.strip()

    def ask(self, cmd: str) -> str:
        self.send(cmd)
        return self.reply()


@pytest.fixture
def agents(lab):
    """An agent on the head and on every host; killed and waited for after the test (so that no
    zombie of ours holds up a `down`)."""
    started = {}
    try:
        for where in ["head"] + [h.name for h in lab.hosts]:
            started[where] = Agent(lab, where)
        yield started
    finally:
        for agent in started.values():
            agent.proc.kill()
            agent.proc.wait()


def _connect(agents: dict[str, Agent], src: str, dst: str, timeout_s: float = 1.0) -> str:
    return agents[src].ask(f"connect {agents[dst].address} {agents[dst].port} {timeout_s}")


def _until(check, timeout_s: float = 10.0) -> float:
    """Seconds until check() holds (polled every 20 ms); fails after timeout_s."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def _rate_mbit(agents: dict[str, Agent], src: str, dst: str, seconds: float = 1.5) -> float:
    """A TCP stream src -> dst as its receiver sees it, after a 0.5 s start."""
    assert agents[src].ask(f"open {agents[dst].address} {agents[dst].port}") == "ok"
    agents[src].send(f"send {10**10} {seconds + 1}")
    time.sleep(0.5)
    n0, t0 = int(agents[dst].ask("received").split()[0]), time.monotonic()
    time.sleep(seconds)
    n1, t1 = int(agents[dst].ask("received").split()[0]), time.monotonic()
    agents[src].reply()
    return (n1 - n0) * 8 / (t1 - t0) / 1e6
