"""Send a workload to an OpenAI-compatible endpoint and observe every request.

Works against the pdcluster router or any vLLM-style server: streaming
`/v1/completions` with token-id prompts, `ignore_eos`, `include_usage`, and
vLLM's `return_token_ids` (so chunks are counted in tokens, not guessed from
text). Sending is closed loop (`max_concurrency` in flight), optionally capped
by a request rate with burstiness (vLLM's benchmark_serving convention: gamma
inter-arrivals, 1 = Poisson, 0 = fixed spacing), or paced by trace timestamps.
Every request ends as a `RequestResult`; a failure is recorded, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from pdcluster.cluster.replay.records import BenchRequest, RequestResult
from pdcluster.proto.load_phases import replay_request_id


@dataclass(frozen=True)
class DriveConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str | None = None
    max_concurrency: int | None = 8  # None: no cap
    request_rate: float | None = None  # requests/s; None: as fast as slots free
    burstiness: float = 1.0
    duration_s: float | None = None  # stop sending after this long (in-flight requests finish)
    follow_timestamps: bool = False  # trace replay: send at each request's arrival_s
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True
    api_key: str | None = field(default=None, repr=False)  # sent as `Authorization: Bearer <key>`
    # A 429 (the server's admission control) is resent after its Retry-After, at most this
    # many times; 0: it ends the request (counted as rejected, apart from failures).
    retries_after_429: int = 0
    # Names this replay's requests (`bench-<token>-<phase>-<index>`, proto/load_phases.py): one
    # per replay, so that two replays of one process on one cluster stay apart in its records.
    replay_token: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}




def _inter_arrival(rng: random.Random, rate: float, burstiness: float) -> float:
    if burstiness == 0:
        return 1.0 / rate
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def send_offsets(requests: Sequence[BenchRequest], cfg: DriveConfig) -> Iterator[float]:
    """When each request of a phase arrives, in seconds from the phase's start (it is then sent
    as soon as one of `max_concurrency` slots is free, first come first served): a trace's
    timestamps, or gaps drawn for `request_rate` (seeded by `cfg.seed`), or all at once.
    The virtual clock (cluster/sim/virtual/) replays loads with the same arrivals."""
    rng = random.Random(cfg.seed)
    next_send = 0.0
    for req in requests:
        if cfg.follow_timestamps and req.arrival_s is not None:
            next_send = req.arrival_s
        yield next_send
        if cfg.request_rate and not cfg.follow_timestamps:
            next_send += _inter_arrival(rng, cfg.request_rate, cfg.burstiness)


async def send_one(client: httpx.AsyncClient, cfg: DriveConfig, req: BenchRequest) -> RequestResult:
    body = {"prompt": list(req.prompt_token_ids), "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if cfg.model:
        body["model"] = cfg.model
    # Named by the client (X-Request-Id, as vLLM's server takes it): a request that fails before
    # its stream starts is still found in the router's timeline.
    client_id = replay_request_id(f"bench-{cfg.replay_token}", req.phase, req.index)
    res = RequestResult(index=req.index, phase=req.phase, prompt_tokens=len(req.prompt_token_ids),
                        start_s=time.monotonic(), end_s=0.0, expected_cached_tokens=req.expected_cached_tokens,
                        request_id=f"cmpl-{client_id}")
    try:
        while True:  # once, or again after each 429 while retries are left
            async with client.stream("POST", f"{cfg.base_url}/v1/completions", json=body, timeout=cfg.timeout_s,
                                     headers={"X-Request-Id": client_id}) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    res.error = f"HTTP {r.status_code}: {_error_message(text)}"
                    if r.status_code == 429:
                        res.rejections += 1
                        if res.rejections <= cfg.retries_after_429:
                            await asyncio.sleep(_retry_after_s(r.headers.get("retry-after")))
                            res.error = None
                            continue
                        res.rejected = True
                    return res
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        _take_event(res, json.loads(line[6:]), time.monotonic())
            break
        if res.error is None and res.output_tokens == 0:
            res.error = "the stream ended without any output token"
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
    finally:
        res.end_s = time.monotonic()
    return res


def _retry_after_s(header: str | None) -> float:
    """Retry-After in seconds (the router sends whole seconds); 1 if absent or unreadable."""
    try:
        return max(0.0, float(header)) if header is not None else 1.0
    except ValueError:
        return 1.0


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]


def _take_event(res: RequestResult, event: dict, now: float) -> None:
    if "error" in event:  # an error after the stream started (OpenAI/vLLM style)
        res.error = f"stream error: {event['error'].get('message', event['error'])}"
        return
    res.request_id = event.get("id") or res.request_id  # the server's own id, when it names one
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else (1 if choice.get("text") else 0)  # servers without token ids
        if ids:
            res.token_ids.extend(ids)
        if n:
            res.chunk_s.append(now)
            res.chunk_tokens.append(n)
    usage = event.get("usage")
    if usage:
        res.output_tokens = usage.get("completion_tokens", sum(res.chunk_tokens))
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")
        res.pd = usage.get("pd")


async def run_phase(requests: list[BenchRequest], cfg: DriveConfig, label: str) -> list[RequestResult]:
    """Send these requests (one phase), wait for all of them, return results in send order."""
    cap = cfg.max_concurrency or max(1, len(requests))  # no cap: a slot for every request
    slots = asyncio.Semaphore(cap)
    tasks: list[asyncio.Task] = []
    bar = _progress(len(requests), label, cfg.progress)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(limits=limits, headers=cfg.headers) as client:
        t0 = time.monotonic()
        deadline = t0 + cfg.duration_s if cfg.duration_s is not None else None

        async def one(req: BenchRequest) -> RequestResult | None:
            # Arrivals follow their schedule; a request then waits for a free slot,
            # and its latency counts from when it is sent (as benchmark_serving does).
            async with slots:
                if deadline is not None and time.monotonic() >= deadline:
                    return None  # the time-bounded window closed before it could be sent
                result = await send_one(client, cfg, req)
            bar.update(1)
            return result

        for req, offset_s in zip(requests, send_offsets(requests, cfg)):
            await asyncio.sleep(max(0.0, t0 + offset_s - time.monotonic()))
            if deadline is not None and time.monotonic() >= deadline:
                break
            tasks.append(asyncio.create_task(one(req)))
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
    bar.close()
    return results


def _progress(total: int, label: str, enabled: bool):
    from tqdm import tqdm

    # disable=None: tqdm draws only on a terminal, so logs and CI output stay clean.
    return tqdm(total=total, desc=label, unit="req", disable=None if enabled else True, leave=False,
                dynamic_ncols=True)
