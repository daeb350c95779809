"""The lab's processes and links as the kernel shows them (cluster/lab.py): which processes live in
a host's namespace or the head's session, whether one can still act, killing them all, and
whether a link or namespace exists. Read from /proc and `ip`; nothing here creates anything."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from pdcluster.cluster.lab_tc import LabError
from pdcluster.cluster.lab_tc import run as _run


def _link_exists(ifname: str) -> bool:
    return _run(["ip", "link", "show", "dev", ifname], check=False).returncode == 0


def _netns_list() -> set[str]:
    return {line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()}


def _netns_pids(netns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def _proc(pid: int | str, what: str) -> str:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""  # gone meanwhile


def _session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (not zombies: those only wait for PID 1 to reap them)."""
    stats = {int(pid): _proc(pid, "stat").rsplit(")", 1)[-1].split() for pid in filter(str.isdigit, os.listdir("/proc"))}
    return [pid for pid, f in stats.items() if len(f) > 3 and f[3] == str(sid) and f[0] != "Z"]  # state ppid pgrp sid


def _rss_kb(pid: int) -> int:
    m = re.search(r"VmRSS:\s+(\d+)", _proc(pid, "status"))
    return int(m.group(1)) if m else 0


# /proc/PID/stat's flags: the task is in do_exit (it never returns to user space).
_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _can_act(pid: int) -> bool:
    """Whether a process can still run code of its own: it exists, is not exiting, and has no
    SIGKILL pending. A killed process may take seconds to leave (in uninterruptible sleep, or
    freeing gigabytes of memory on a loaded machine), but it never runs again."""
    stat = _proc(pid, "stat").rsplit(")", 1)[-1].split()  # state ppid pgrp ... flags is the 7th
    if len(stat) < 7 or stat[0] in ("Z", "X", "x") or int(stat[6]) & _PF_EXITING:
        return False
    pending = re.findall(r"^(?:SigPnd|ShdPnd):\s+([0-9a-f]+)", _proc(pid, "status"), re.M)
    return not any(int(mask, 16) & _SIGKILL_BIT for mask in pending)


def _kill_all(find, reap: bool, timeout_s: float = 10.0) -> None:
    """SIGKILL what `find()` lists until none of it can act any more (`_can_act`). `reap`: then wait
    (a few seconds at most) until the processes are gone and PID 1 has reaped them, so that a `ps`
    right after shows no zombie of ours; one still exiting then is left to finish on its own."""
    deadline, killed = time.monotonic() + timeout_s, set()
    while pids := [pid for pid in find() if _can_act(pid)]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        if time.monotonic() > deadline:
            raise LabError(f"processes still running after SIGKILL: {pids}")
        time.sleep(0.05)
    while reap and any(Path(f"/proc/{pid}").exists() for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
