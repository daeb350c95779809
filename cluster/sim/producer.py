"""P's KV side in the simulated engine: what vLLM's KV connector does on a producer.

Every step that computes prompt tokens of a request, its blocks' rows get their
bytes (payload.py) and the request's transfer source (transfer/sources.py) is
told how far the prompt is computed, in which blocks; P's KvServer
(transfer/grpc_server.py) streams ready blocks to whichever D asks, so in push
mode D pulls each chunk's blocks while P computes the next. A finished prefill
keeps its blocks until D releases the source or its lease expires
(`SourceTable.take_finished`), as the real connector's delay-free.
"""

from __future__ import annotations

import torch

from pdcluster.cluster.sim import payload
from pdcluster.cluster.sim.cost import Component
from pdcluster.cluster.sim.request import SimRequest
from pdcluster.cluster.sim.scheduler import KvHooks, Scheduler
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.sources import SourceTable, TransferIds


class ProducerSide(KvHooks):
    def __init__(self, engine_id: str, components: tuple[Component, ...], kv: PagedKv, block_size: int,
                 host: str, port: int, chunk_bytes: int, lease_s: float, timeout_s: float,
                 break_prefix: str | None, channel_backend: str | None, secret: str, advertise: str | None = None,
                 require_seal: bool = False):
        self.components = components
        self.kv = kv
        self.block_size = block_size
        self.lease_s = lease_s
        self.sources = SourceTable({c.name: i for i, c in enumerate(components)}, (block_size,) * len(components))
        self.server = KvServer(engine_id, kv, self.sources, host, port, chunk_bytes, secret=secret, wait_s=timeout_s,
                               break_prefix=break_prefix, channel_backend=channel_backend, advertise=advertise,
                               require_seal=require_seal)
        self.scheduler: Scheduler | None = None
        self.transfer_ids: dict[str, str] = {}  # request id -> the transfer it produces
        self.ids_in_use = TransferIds(lease_s)  # the transfer ids in use (the engine's prefill takes each)
        self._ran: set[str] = set()  # requests a step has computed (the source exists)
        self._keys: dict[str, object] = {}  # request id -> its blocks' keys (numpy), while it computes

    def produce(self, request_id: str, transfer_id: str) -> None:
        self.transfer_ids[request_id] = transfer_id

    def computed(self, req: SimRequest, start: int, end: int) -> None:
        transfer_id = self.transfer_ids.get(req.request_id)
        if transfer_id is None:
            return
        keys = self._keys.get(req.request_id)
        if keys is None:
            keys = self._keys[req.request_id] = payload.block_keys(req.block_hashes, req.prompt_token_ids,
                                                                   self.block_size)
        bs, n = self.block_size, req.num_prompt_tokens
        ids = list(req.blocks)
        first, last = start // bs, -(-end // bs)  # blocks this step wrote (a partial first one included)
        for gi, c in enumerate(self.components):
            # Rows of the blocks this step computed that the component keeps to the end: all of
            # them (full, compressed), the final window's (window), the last block (state). The
            # source marks every layer ready to the step's end, so a block D may read is written.
            lo = max(first, self._tail_start(c, n))
            payload.fill(self.kv, gi, c.name, ids[lo:last], keys[lo:last])
        table = tuple(tuple(ids) for _ in self.components)
        self.sources.step(transfer_id, req.request_id, n, table, end)
        self._ran.add(req.request_id)

    def _tail_start(self, c: Component, num_tokens: int) -> int:
        """The first block index of a prompt this component keeps (and D may ask for)."""
        bs = self.block_size
        if c.kind == "window":
            return (num_tokens - c.window_tokens) // bs if num_tokens > c.window_tokens else 0
        if c.kind == "state":
            return (num_tokens - 1) // bs
        return 0

    def offer_pool(self, transfer_id: str, block_hashes: list, tokens: list[int], lease_s: float) -> None:
        """The pool: a prompt's first blocks (`tokens`, whole blocks), which the instance's tier holds
        (its book), offered to a peer's read as a pooled source. Their bytes are their keys' rows, as
        P's steps wrote them (payload.py): made as they are read."""
        keys = payload.block_keys(block_hashes, tokens, self.block_size)
        widths = {c.name: self.kv.view(c.name).shape[1] for c in self.components}
        self.sources.offer_pooled(transfer_id, _PayloadRun(keys, widths), len(tokens), lease_s)

    def step_done(self) -> None:
        self.sources.step_done()

    def finished(self, req: SimRequest) -> bool:
        self._keys.pop(req.request_id, None)
        transfer_id = self.transfer_ids.pop(req.request_id, None)
        if transfer_id is None or req.request_id not in self._ran:
            return False  # never computed: no source, nothing for D
        self._ran.discard(req.request_id)
        # Aborted or not, a D may be reading the blocks right now: keep them until the source ends.
        self.sources.finish(transfer_id, self.lease_s, aborted=req.finish_reason not in ("length", "stop"))
        return True

    def preempted(self, req: SimRequest) -> None:
        if req.request_id in self._ran:
            self.sources.preempted(req.request_id)

    def poll(self) -> None:
        if self.scheduler is not None and self.scheduler.held:
            done = self.sources.take_finished()
            if done:
                self.scheduler.release(done)

    def stop(self) -> None:
        self.server.stop()


class PrefillSide(KvHooks):
    """P's hooks: its producer's at every step, and a consumer's (consumer.py) for a prefill that
    reads a peer P's tier first (the pool, `PrefillRequest.pool`) into the producer's own blocks:
    the steps after the read compute the rest, and D pulls the whole prompt as usual."""

    def __init__(self, producer: ProducerSide, consumer: KvHooks):
        self.producer, self.consumer = producer, consumer

    @property
    def scheduler(self) -> Scheduler | None:
        return self.producer.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self.producer.scheduler = self.consumer.scheduler = scheduler

    def computed(self, req: SimRequest, start: int, end: int) -> None:
        self.producer.computed(req, start, end)

    def step_done(self) -> None:
        self.producer.step_done()

    def start_load(self, req: SimRequest) -> None:
        self.consumer.start_load(req)

    def cancel_load(self, req: SimRequest) -> None:
        self.consumer.cancel_load(req)

    def finished(self, req: SimRequest) -> bool:
        return self.producer.finished(req)

    def preempted(self, req: SimRequest) -> None:
        self.producer.preempted(req)

    def poll(self) -> None:
        self.producer.poll()


class _PayloadRun:
    """A pooled source's blocks in the simulated tier (transfer/sources.py TierRead): their rows,
    made from their keys when the KV server reads them."""

    def __init__(self, keys, widths: dict[str, int]):
        self.keys, self.widths = keys, widths

    def gather(self, layer: str, group: int, indices) -> torch.Tensor:
        return payload.rows(self.keys[list(indices)], group, self.widths[layer])

    def close(self) -> None:
        pass
