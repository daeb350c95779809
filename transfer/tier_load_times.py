"""How long P's worker took to load each prefill's host-tier hit, handed to its engine actor.

The worker copies a request's tier blocks back into the device cache at the start of the step
that schedules it (transfer/host_tier.py); the actor answers the router once vLLM's output for the
request arrives. vLLM (0.32) gives P's connector the finished request before that step's worker
output, so the time cannot ride P's `kv_transfer_params`; nor can the actor ask the worker then
without waiting for its next step. Instead the worker writes it, under the transfer's id, into a
small file beside the instance's refusal counts (transfer/refusal_counts.py: a directory only the
instance's user can enter, named in the environment vLLM's processes inherit, removed with the
actor), and the actor reads it when the output arrives: the write happened before the output left
the engine.

The file is SLOTS fixed slots of (16-byte key, int64 nanoseconds); a transfer's slot is its key's
first bytes modulo SLOTS. A slot a later transfer took over reads as unknown (0), never as
another's time.
"""

from __future__ import annotations

import hashlib
import os
import struct

from pdcluster.transfer import refusal_counts

SLOTS = 4096
_SLOT = struct.Struct("<16sq")
_NAME = "tier-loads"


def _path() -> str | None:
    where = refusal_counts.shared_dir()
    return os.path.join(where, _NAME) if where else None


def _key(transfer_id: str) -> tuple[bytes, int]:
    key = hashlib.sha256(transfer_id.encode()).digest()[:16]
    return key, int.from_bytes(key[:4], "little") % SLOTS * _SLOT.size


class LoadTimes:
    """One process's end of the file (the worker writes, the actor reads); without a shared
    directory (tests, or a body that shares none) it keeps nothing and reads 0."""

    def __init__(self, path: str | None = None):
        self.path = path if path is not None else _path()
        self._fd: int | None = None
        if self.path is not None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(self._fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(self._fd, SLOTS * _SLOT.size)

    def write(self, transfer_id: str, load_ns: int) -> None:
        if self._fd is not None:
            key, at = _key(transfer_id)
            os.pwrite(self._fd, _SLOT.pack(key, load_ns), at)

    def read(self, transfer_id: str) -> int:
        """The load's time in ns; 0 if unknown (none written, or its slot reused since)."""
        if self._fd is None:
            return 0
        key, at = _key(transfer_id)
        got, ns = _SLOT.unpack(os.pread(self._fd, _SLOT.size, at))
        return ns if got == key else 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
