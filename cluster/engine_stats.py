"""A vLLM stat logger that keeps the latest scheduler stats, for the actor to report.

vLLM calls `record` after every engine step with that step's SchedulerStats;
keeping the last one answers "how full is this engine right now" without
reaching into the EngineCore process.
"""

from __future__ import annotations

from pdcluster.proto.messages import EngineLoad
from pdcluster.transfer.vllm_compat import StatLoggerBase


class LatestSchedulerStats(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.load = EngineLoad(kv_cache_usage=0.0, running=0, waiting=0, steps=0)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is not None:
            self.load = EngineLoad(kv_cache_usage=scheduler_stats.kv_cache_usage,
                                   running=scheduler_stats.num_running_reqs,
                                   waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                                   steps=self.load.steps + 1)

    def log_engine_initialized(self):
        pass
