"""How many peers each plane of an instance refused, counted across the instance's processes.

An instance's planes live in several processes: the request channel in the engine actor, the
KV-event publisher in vLLM's engine core, the KV service and the channel liveness listener in
vLLM's worker. The actor calls `share()` before it starts vLLM: a small file in a directory
only its user can enter, named in the environment its children inherit; every process counts
its refusals into it (`count`, from auth.py's Refusals) and the actor reads the sum (`read`) for
the router's /metrics. A process with no shared file counts in memory. The directory is removed
when the actor exits, or, when Ray killed it, by the next share() on the host (`_sweep`).

The file holds one little-endian int64 per plane of PLANES. Several threads and processes add
to it: each add holds the process's lock and an flock on the file.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import struct
import tempfile
import threading

from pdcluster.proto.messages import RefusalCounts

PLANES: tuple[str, ...] = tuple(RefusalCounts.__dataclass_fields__)
ENV = "PDC_REFUSALS_FILE"
_PREFIX = "pdc-refusals-"  # + the maker's pid + "-" + mkdtemp's suffix
_SLOT = struct.Struct("<q")

_lock = threading.Lock()  # holds: _local, _fd, _owner
_local = dict.fromkeys(PLANES, 0)  # the counts while no file is shared
_fd: tuple[int, str, int] | None = None  # (pid, path, fd): the file this process opened
_owner: int | None = None  # the pid that made the shared file (a child inherits its path, not this)


def share() -> str:
    """Make this process's counts one file its children add to (once a process; the path)."""
    global _owner
    with _lock:
        if _owner == os.getpid():
            return os.environ[ENV]
        _sweep(tempfile.gettempdir())
        where = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")  # 0700, ours
        path = os.path.join(where, "counts")
        with open(path, "wb") as f:
            f.write(b"".join(_SLOT.pack(_local[p]) for p in PLANES))
        atexit.register(shutil.rmtree, where, True)
        os.environ[ENV], _owner = path, os.getpid()
        return path


def shared_dir() -> str | None:
    """The directory of the shared file (only this user can enter it; removed with its maker), for
    other files an instance's processes share; None when none is shared."""
    path = os.environ.get(ENV)
    return os.path.dirname(path) if path else None


def _sweep(tmp: str) -> None:
    """Remove the directories of this naming that this user made in processes now gone: an actor
    Ray kills runs no atexit. Nothing else is touched (another user's, a live maker's, any other
    name)."""
    for entry in os.scandir(tmp):
        pid = entry.name.removeprefix(_PREFIX).split("-", 1)[0]
        if not entry.name.startswith(_PREFIX) or not pid.isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its maker is gone
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:  # alive under another user, or gone from under us meanwhile
            continue


def _file() -> int | None:
    """This process's descriptor of the shared file, if one is shared. Under _lock."""
    global _fd
    path = os.environ.get(ENV)
    if not path:
        return None
    if _fd is None or _fd[0] != os.getpid() or _fd[1] != path:  # a forked child opens its own
        try:
            _fd = (os.getpid(), path, os.open(path, os.O_RDWR))
        except OSError:  # gone (its maker exited): count here
            return None
    return _fd[2]


def count(plane: str) -> None:
    """One refusal on `plane` (one of PLANES)."""
    at = PLANES.index(plane) * _SLOT.size
    with _lock:
        fd = _file()
        if fd is None:
            _local[plane] += 1
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            (n,) = _SLOT.unpack(os.pread(fd, _SLOT.size, at))
            os.pwrite(fd, _SLOT.pack(n + 1), at)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def read() -> RefusalCounts:
    """The counts of this process and every child that shares its file."""
    with _lock:
        fd = _file()
        if fd is None:
            return RefusalCounts(**_local)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            data = os.pread(fd, _SLOT.size * len(PLANES), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    return RefusalCounts(*(n for (n,) in _SLOT.iter_unpack(data)))
