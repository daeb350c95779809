"""How a simulated instance's step times vary around the cost model's (params `variation`).

Real engines' steps are not all the model's mean: on the tiny model's P1D1 (docs/sim.md
"Step-time variation") a D step's time, over what the fitted model says, has a spread of ~0.3
in its logarithm, a third of it shared by the steps around it for dozens of steps (host
contention, P's prefill beside D, whatever the model leaves out), so whole requests decode
faster or slower than others at the same batch. `StepVariation` multiplies each step's time
by a factor drawn for it:

- a decode-only step: exp(decode_sd * z_step + drift_sd * z_window - (decode_sd^2 + drift_sd^2) / 2),
  z_window one draw per `drift_steps` consecutive steps of the instance;
- a step with prompt chunks: exp(prefill_sd * z_step - prefill_sd^2 / 2);

the mean factor is 1, so a run's means stay the model's. Each draw is a function of the
instance's name, the file's seed and the step's index on that instance (a counter-based
generator: splitmix64 of the three), never of how the driver batches them: a run of repeated
decode steps cut short (cluster/sim/virtual/instance.py) gets exactly the factors the steps
one by one would, and the same run twice the same records.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from pdcluster.cluster.sim.sim_params import Variation

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
# Independent streams, two lanes each (Box-Muller takes two uniforms).
_STEP, _WINDOW, _PREFILL = 0, 2, 4


def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def normals(key: int, counters: np.ndarray, stream: int) -> np.ndarray:
    """Standard normal draws, one per counter, a pure function of (key, counter, stream)."""
    base = np.uint64(key & 0xFFFFFFFFFFFFFFFF)
    c = counters.astype(np.uint64) * np.uint64(8)
    u1, u2 = (((_splitmix64(base ^ _splitmix64(c + np.uint64(stream + lane))) >> np.uint64(11)) + 0.5) / 2.0 ** 53
              for lane in (0, 1))
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class StepVariation:
    def __init__(self, spec: Variation, instance: str):
        self.spec = spec
        self.active = bool(spec.decode_sd or spec.drift_sd or spec.prefill_sd)
        self._key = zlib.crc32(instance.encode()) ^ (spec.seed << 32)

    def apply(self, durations: Sequence[float], first_step: int, decode: bool) -> list[float]:
        """The times of the instance's steps `first_step`, `first_step + 1`, ... (their model
        times `durations`), each varied; decode: decode-only steps, else steps with prompt chunks."""
        if not self.active:
            return list(durations)
        s = self.spec
        n = np.arange(first_step, first_step + len(durations), dtype=np.uint64)
        if decode:
            log = (s.decode_sd * normals(self._key, n, _STEP)
                   + s.drift_sd * normals(self._key, n // np.uint64(s.drift_steps), _WINDOW)
                   - (s.decode_sd ** 2 + s.drift_sd ** 2) / 2)
        else:
            log = s.prefill_sd * normals(self._key, n, _PREFILL) - s.prefill_sd ** 2 / 2
        return (np.asarray(durations, dtype=float) * np.exp(log)).tolist()
