"""The KV transfer's malloc thresholds (transfer/malloc_tuning.py), each case in a fresh
process: glibc's settings are per process and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A stream's pattern: a few 1 MiB frames alive at once, freed, again. Counts the minor page
# faults of 50 such rounds after 3 to warm up.
_ROUNDS = """
import json, resource, sys
from pdcluster.transfer.malloc_tuning import tune_malloc_for_transfer
tuned = [tune_malloc_for_transfer(), tune_malloc_for_transfer()] if sys.argv[1] == "tune" else []
src = memoryview(bytearray(b"x" * (1 << 20)))
def rounds(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        held = [b"".join((b"header", src)) for _ in range(4)]
        del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
rounds(3)
print(json.dumps({"tuned": tuned, "faults": rounds(50)}))
"""


def _run(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], env={**clean, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_without_tuning_glibc_faults_the_frames_in_again_every_round():
    assert _run("plain")["faults"] > 50 * 256  # at least one 1 MiB buffer's pages per round


def test_tuned_the_frames_stay_mapped_and_tuning_is_once():
    got = _run("tune")
    assert got["tuned"] == [True, True]
    assert got["faults"] < 50, got  # a handful at most, not a buffer's 256 pages per round


def test_the_users_malloc_variables_win():
    got = _run("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert got["tuned"] == [False, False]
    assert got["faults"] > 50 * 256  # the user's (default-like) setting stands
