"""Typed messages between the router and the P/D engine actors.

Everything that crosses between them (a Ray call, or a request channel frame:
transfer/channel_wire.py) is one of these frozen dataclasses: pickled by Ray, msgpack
typed by msgspec on the request channel. Token ids, never text: the router owns the
tokenizer, engines run with `skip_tokenizer_init=True`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.kv_groups import KvGroup

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class StructuredSpec:
    """vLLM's StructuredOutputsParams, one constraint of: `json` (a JSON schema, as JSON text),
    `regex`, `choice`, `grammar` (EBNF), `json_object`; D's vLLM applies it as it samples
    (router/structured_outputs.py reads it from a request)."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # xgrammar's structural tag (JSON text): a client's structured_outputs.structural_tag, or what
    # vLLM's tool parsers force a tool call with (router/chat_parsers.py).
    structural_tag: str | None = None


@dataclass(frozen=True)
class SamplingSpec:
    """The subset of vLLM SamplingParams the router forwards."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (vLLM's -1)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's output_kind FINAL_ONLY, as its server sets for a request that is not streamed:
    # D sends one delta at the end, every token in it with its time (DecodeDelta.token_ns),
    # instead of one per `router.stream_interval` tokens. The router asks for it when it has
    # nothing to do with tokens before the end (not streamed, no stop strings): every delta
    # costs the router CPU (bench/README.md, "The router's own overhead").
    final_only: bool = False
    # Keep the prompt's blocks in the host KV tiers ahead of others for so long (0: no hint);
    # transfer/tier_scheduler.py caps it at MAX_RETENTION_S.
    retain_s: float = 0.0
    # vLLM's, with its meaning; checked by the router (router/sampling_checks.py).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): vLLM's dict, in order
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words as its tokenizer splits them (the router's: the engines run without one).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's logprobs: each generated token's, with so many top alternatives (-1: the whole
    # vocabulary); None: none. D computes them (router/logprobs.py shapes them for the client).
    logprobs: int | None = None
    structured: StructuredSpec | None = None  # vLLM's structured outputs (D samples under them)
    # vLLM's n: so many sequences sampled from the prompt, which is prefilled once (D's
    # cluster/parallel_sampling.py); each choice's seed is `seed` + its index, as vLLM's.
    n: int = 1
    # vLLM's prompt_logprobs: each prompt token's, as logprobs. Whoever prefills computes them (P,
    # or D prefilling alone), every prompt token anew: vLLM reads no cached prefix for them.
    prompt_logprobs: int | None = None
    # vLLM's reasoning_ended, for a structured constraint under a reasoning parser: True, sample
    # under it from the first token; None, from where D's reasoning parser sees reasoning end.
    reasoning_ended: bool | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs as vLLM's engine gives them, in its order: the sampled token
    first, then the top alternatives by rank (a token among both appears once, first)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # -inf where vLLM gives it
    ranks: tuple[int | None, ...] = ()  # each token's rank in the vocabulary (1: the likeliest)

    @classmethod
    def from_vllm(cls, position) -> TokenLogprobs:
        """From vLLM's dict[int, Logprob] of one position (a FlatLogprobs yields those too)."""
        return cls(tuple(position), tuple(lp.logprob for lp in position.values()),
                   tuple(lp.rank for lp in position.values()))

    @classmethod
    def prompt_from_vllm(cls, positions) -> tuple[TokenLogprobs | None, ...]:
        """vLLM's prompt_logprobs (the first position None: nothing precedes it)."""
        return tuple(None if p is None else cls.from_vllm(p) for p in positions or ())


@dataclass(frozen=True)
class EngineTimes:
    """vLLM's own request timestamps (RequestStateStats), as time.monotonic_ns of the
    engine's host; 0 where vLLM did not record one."""

    queued_ns: int = 0
    scheduled_ns: int = 0  # first scheduled to compute (for D: after its KV arrived)
    first_token_ns: int = 0

    @classmethod
    def from_vllm(cls, stats) -> EngineTimes:
        if stats is None:
            return cls()
        ns = lambda s: int(s * 1e9) if s else 0  # noqa: E731  (vLLM: float seconds, 0.0 = unset)
        return cls(ns(stats.queued_ts), ns(stats.scheduled_ts), ns(stats.first_token_ts))


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    transfer_id: str = ""  # the router's name for the P->D transfer; "": the request id
    # A peer P's host tier offering the prompt's first blocks (the pool, OpenPool's offer): P reads
    # them over the KV plane and computes the rest; None: P computes what its own caches lack.
    pool: TransferHandle | None = None


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    # What another connector than pdcluster's returned in kv_transfer_params (vLLM's NIXL: where
    # D reads P's blocks), passed on to D; None with pdcluster's, whose handle the router builds.
    connector_params: dict | None
    prompt_tokens: int
    p_cached_tokens: int  # P's own prefix-cache hit
    engine: EngineTimes = EngineTimes()
    p_tier_tokens: int = 0  # of p_cached_tokens, those P loaded from its host KV tier
    p_tier_load_ns: int = 0  # the time P's worker took to load them (0: none, or not known)
    # Of p_cached_tokens, those P read from a peer's host tier (PrefillRequest.pool), and its read's
    # report (None: no read); a read that failed is computed (or the prefill fails, as on_failure says).
    p_pool_tokens: int = 0
    p_pool: TransferStats | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # when SamplingSpec.prompt_logprobs asked


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    # Where P's KV is, built by the router (with the transport it chose); None: D prefills the
    # prompt itself, or another connector's `connector_params` say where.
    handle: TransferHandle | None
    connector_params: dict | None = None  # P's connector's kv_transfer_params, as P returned them


@dataclass(frozen=True)
class PoolRequest:
    """Offer a peer the run of this prompt's first blocks the instance's host KV tier holds (the
    pool, docs/kv_tiers.md), as transfer `transfer_id`, under the transfer's lease."""

    transfer_id: str
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class PoolOffer:
    """What the holder offers: the prompt tokens its tier's run covers (0: nothing offered, no
    tier, or the run went), ready at once at its KV address under the request's transfer id."""

    transfer_id: str
    num_tokens: int


@dataclass(frozen=True)
class TransferStats:
    """D's report of one request's transfer: the one shape from D's KV side to the record.

    D's side writes it in three moves: `planned` when it plans the load, `pulled` when the pull
    ends, `failed` when nothing usable came. The vLLM connector (transfer/connector.py), the
    simulated engine (cluster/sim/consumer.py) and the virtual clock (cluster/sim/virtual/kv.py)
    all do; vLLM carries it out of EngineCore as builtins (`to_params` / `from_params`)."""

    d_cached_tokens: int = 0  # D's own prefix-cache hit
    transferred_tokens: int = 0
    blocks_per_group: tuple[int, ...] = ()
    bytes_per_group: tuple[int, ...] = ()
    error: str | None = None
    group_names: tuple[str, ...] = ()  # each KV-cache group's, for reports ("full_attention (FullAttentionSpec)", "c4_kv")
    # time.monotonic_ns of D's host; 0: not recorded (nothing pulled)
    transfer_start_ns: int = 0
    transfer_end_ns: int = 0
    kv_ready_ns: int = 0  # D's scheduler saw the pull finish
    d_tier_tokens: int = 0  # of d_cached_tokens, those D loaded from its host KV tier
    # D's worker loading them (D's host clock; 0: no load), before it started the pull
    d_tier_load_start_ns: int = 0
    d_tier_loaded_ns: int = 0

    @classmethod
    def planned(cls, d_cached_tokens: int, transferred_tokens: int, blocks_per_group: tuple[int, ...],
                bytes_per_block: tuple[int, ...], transfer_start_ns: int = 0,
                group_names: tuple[str, ...] = (), d_tier_tokens: int = 0) -> TransferStats:
        """D's plan: the tokens its cache holds (of them, `d_tier_tokens` in its host tier) and those
        coming from P, per KV-cache group the blocks that come and their bytes (and the groups' names)."""
        return cls(d_cached_tokens, transferred_tokens, tuple(blocks_per_group),
                   tuple(n * b for n, b in zip(blocks_per_group, bytes_per_block)), group_names=tuple(group_names),
                   transfer_start_ns=transfer_start_ns, d_tier_tokens=d_tier_tokens)

    def pulled(self, start_ns: int, end_ns: int, bytes_per_group: tuple[int, ...] | None = None) -> TransferStats:
        """The pull ran from `start_ns` to `end_ns`, moving `bytes_per_group` (default: as planned)."""
        moved = self.bytes_per_group if bytes_per_group is None else tuple(bytes_per_group)
        return replace(self, transfer_start_ns=start_ns, transfer_end_ns=end_ns, bytes_per_group=moved)

    def failed(self, error: str, end_ns: int | None = None, moved_bytes: tuple[int, ...] | None = None) -> TransferStats:
        """Nothing usable came from P: no tokens, no blocks; `moved_bytes` what arrived before
        (default: what the pull reported)."""
        return replace(self, error=error, d_cached_tokens=0, transferred_tokens=0, d_tier_tokens=0,
                       blocks_per_group=(0,) * len(self.blocks_per_group),
                       bytes_per_group=self.bytes_per_group if moved_bytes is None else tuple(moved_bytes),
                       transfer_end_ns=self.transfer_end_ns if end_ns is None else end_ns)

    def to_params(self) -> dict:
        """As builtins, for vLLM's kv_transfer_params (it crosses EngineCore's msgpack as a map)."""
        import msgspec

        return msgspec.to_builtins(self)

    @classmethod
    def from_params(cls, params: dict | None) -> TransferStats | None:
        """Back from `to_params`, checked field by field (msgspec.ValidationError names a bad one)."""
        import msgspec

        return None if params is None else msgspec.convert(params, cls)


@dataclass(frozen=True)
class DecodeDelta:
    """New tokens since the last delta; the last one has `finish_reason` set."""

    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    transfer: TransferStats | None = None  # set on the last delta
    num_cached_tokens: int = 0  # D's count: local hit + transferred
    engine: EngineTimes | None = None  # set on the last delta
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token when SamplingSpec.logprobs asked
    stop_reason: int | None = None  # on the last: the stop token id that ended it (vLLM's; None: eos or none)
    # With n > 1 (SamplingSpec.n): the choice these tokens are of, and its end when this delta
    # ends it; `finish_reason` is set on the request's last delta alone.
    index: int = 0
    choice_finish: str | None = None
    # D prefilling alone, asked for them: the prompt's (on the first delta)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
    # When each new token was made (engine's time.monotonic_ns), if the engine sends
    # several steps' tokens in one delta (the simulated engine does, to keep Ray's
    # per-message cost off 90 streams); empty: the router stamps arrival times.
    token_ns: tuple[int, ...] = ()

    def joins(self, later: DecodeDelta) -> bool:
        """`later` can be merged into this one (`then`): the same choice, which this one does not end."""
        return self.finish_reason is None and self.choice_finish is None and later.index == self.index

    def then(self, later: DecodeDelta) -> DecodeDelta:
        """This delta and the next as one, as vLLM's RequestOutputCollector merges outputs its
        consumer has not taken yet. Token times are kept only if both carry them (else the
        router stamps the merged tokens' arrival)."""
        assert self.joins(later), "a delta that ends its choice is its last; another choice's is not merged in"
        stamped = len(self.token_ns) == len(self.new_token_ids) and len(later.token_ns) == len(later.new_token_ids)
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       token_ns=self.token_ns + later.token_ns if stamped else (),
                       logprobs=self.logprobs + later.logprobs,
                       prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


@dataclass(frozen=True)
class PlaneAddresses:
    """Where one instance's planes listen, as it advertises them (transfer/network.py)."""

    host: str = ""  # the address its planes bind (or advertise, with network.bind_all)
    request_channel: str = ""  # host:port
    kv_events: str = ""  # tcp://host:port: the KV-event PUB socket
    kv_events_replay: str = ""  # tcp://host:port: its replay socket


@dataclass(frozen=True)
class InstanceInfo:
    name: str  # "prefill-0"
    role: Role
    index: int
    node_ip: str  # its Ray node's IP
    pid: int
    kv_address: str | None  # P: where its KV server listens (and its torch.distributed channel store)
    engine_id: str
    started_s: float
    extra: dict = field(default_factory=dict)
    planes: PlaneAddresses = PlaneAddresses()
    # Its engine's KV-cache groups (proto/kv_groups.py), for the router's prefix index; empty:
    # unknown (vLLM's NIXL connector), one full-attention group assumed.
    kv_groups: tuple[KvGroup, ...] = ()


@dataclass(frozen=True)
class RefusalCounts:
    """Peers an instance refused since it started, per plane (none of them held the secret, or
    a proof failed): transfer/refusal_counts.py counts them, the router's /metrics shows them."""

    request_channel: int = 0  # connections failing the request channel's handshake
    kv_events: int = 0  # ZMQ peers with an unknown CURVE key at the KV-event publisher
    kv_service: int = 0  # calls to P's gRPC KV service without a good token
    channel_liveness: int = 0  # connections failing the torch.distributed liveness handshake
    nixl_side_channel: int = 0  # malformed messages at vLLM's NIXL side channel (it authenticates no one)


@dataclass(frozen=True)
class EngineLoad:
    """An engine's scheduler state after its latest step (vLLM SchedulerStats)."""

    kv_cache_usage: float  # fraction of KV blocks held by requests (cached-but-free blocks count as free)
    running: int
    waiting: int
    steps: int  # scheduler steps seen so far


@dataclass(frozen=True)
class TierCounts:
    """An instance's host KV tier as it counts itself, since the instance started (docs/kv_tiers.md):
    what it holds, and the copies to and from its device and to peers (the pool)."""

    held_bytes: int = 0
    loaded_blocks: int = 0  # copied back into the device cache (a request's tier hit)
    loaded_bytes: int = 0
    load_seconds: float = 0.0  # the loads' time as the worker issued them (on CUDA: until queued, not done)
    stored_blocks: int = 0  # copied out of the device cache (write-through, at a request's end)
    stored_bytes: int = 0
    served_blocks: int = 0  # offered to peers' reads (the pool)

