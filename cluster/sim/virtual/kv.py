"""P -> D KV on the virtual clock: what producer.py, consumer.py and link.py do, as events.

The real-time sim moves a scaled payload through KvServer / KvFetcher and replays each
chunk D received at full size over the modelled link (link.py). Here nothing moves: D's
plan is the same (`CostModel.blocks_to_send`: full and compressed past D's hit, a window's
and a state's tail), and each block "arrives" when both hold:
- P has computed it: as P's source does (transfer/sources.py), after each P step every block
  wholly below the step's end is ready, and every block once the prompt is done (a P hit's
  blocks are ready after P's first step of the request);
- D has asked: D starts its load when its scheduler admits the request (in push mode while
  P still computes, in pull mode after P is done).
The arrivals (time, full-size bytes) go through the same `modelled_end_ns` as the real
chunks do; D's load ends then. P keeps the request's blocks until every block has arrived
(the real D acknowledges when its pull ends, long before the modelled end), or until its
lease runs out (the transfer then fails, as a pull from an expired source does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdcluster.cluster.sim.cost import CostModel
from pdcluster.cluster.sim.link import LinkModel, modelled_end_ns
from pdcluster.cluster.sim.request import SimRequest
from pdcluster.cluster.sim.scheduler_config import KvHooks
from pdcluster.cluster.sim.virtual.events import EventLoop
from pdcluster.proto.messages import TransferStats
from pdcluster.transfer.sources import ready_blocks


@dataclass
class _Transfer:
    transfer_id: str
    num_tokens: int
    p_request_id: str
    d_request_id: str
    ready: list[tuple[int, int]] = field(default_factory=list)  # (ns, prompt tokens P has computed)
    d_start_ns: int | None = None
    d_hit_tokens: int = 0
    d_tier_tokens: int = 0  # of d_hit_tokens, D's host tier's
    d_tier_load_ns: tuple[int, int] | None = None  # D's tier load: (start, end); the pull starts at its end
    done: bool = False  # every block arrived (or the transfer failed)
    p_released: bool = False
    expired: bool = False  # P's lease ran out first
    stats: TransferStats | None = None


class VirtualKv:
    """Every transfer of one virtual cluster. `release(p_name, ids)` and `load_ended(d_name, rid,
    error)` are the instances' (VirtualInstance) entry points, called through the event loop."""

    def __init__(self, loop: EventLoop, cost: CostModel, lease_s: float,
                 release: Callable[[str, set[str]], None], load_ended: Callable[[str, str, str | None], None]):
        self.loop, self.cost = loop, cost
        self.block_size = cost.block_size
        self.link = LinkModel.of(cost)
        self.lease_ns = round(lease_s * 1e9)
        self._release, self._load_ended = release, load_ended
        self._by_p: dict[str, _Transfer] = {}  # P's request id -> its transfer
        self._by_d: dict[str, _Transfer] = {}
        self._p_of: dict[str, str] = {}  # P's request id -> P's name
        self._d_of: dict[str, str] = {}

    def expect(self, transfer_id: str, num_tokens: int, p_name: str, p_request_id: str, d_name: str,
               d_request_id: str) -> None:
        """The router sent one request to P and D (push: both now; pull: D once P is done)."""
        t = _Transfer(transfer_id, num_tokens, p_request_id, d_request_id)
        self._by_p[p_request_id], self._by_d[d_request_id] = t, t
        self._p_of[p_request_id], self._d_of[d_request_id] = p_name, d_name

    def expect_pool(self, transfer_id: str, num_tokens: int, holder: str, d_name: str, d_request_id: str) -> None:
        """A reader (D, or a P: `d_name` and `d_request_id` name the reader and its request) reads a
        prompt's first `num_tokens` from `holder`'s host tier (the pool): ready at once, no P request
        holds them (the holder's tier keeps them; not modelled: its eviction meanwhile)."""
        t = _Transfer(transfer_id, num_tokens, f"{transfer_id}#pool", d_request_id,
                      ready=[(self.loop.now_ns, num_tokens)], p_released=True)
        self._by_d[d_request_id], self._d_of[d_request_id] = t, d_name

    def stats(self, d_request_id: str) -> TransferStats | None:
        """D's report of the transfer (None if D never started its load), and forget it."""
        t = self._by_d.pop(d_request_id, None)
        self._d_of.pop(d_request_id, None)
        return t.stats if t is not None else None

    def producer(self) -> KvHooks:
        """P's hooks: its steps make D's blocks ready, and it may read a peer's tier first (the pool)."""
        return _PrefillHooks(self)

    def consumer(self) -> KvHooks:
        return _ConsumerHooks(self)

    # -- the transfer's progress

    def _p_computed(self, t: _Transfer, end: int) -> None:
        t.ready.append((self.loop.now_ns, min(end, t.num_tokens)))
        self._maybe_done(t)

    def _d_started(self, t: _Transfer, hit_tokens: int, tier_tokens: int, tier_load_ns: int = 0) -> None:
        """D's load began: its tier's part first (`tier_load_ns`, in the step that began it), then the pull."""
        t.d_tier_load_ns = (self.loop.now_ns, self.loop.now_ns + tier_load_ns) if tier_load_ns else None
        t.d_start_ns, t.d_hit_tokens, t.d_tier_tokens = self.loop.now_ns + tier_load_ns, hit_tokens, tier_tokens
        if t.expired:
            self._fail(t, "KV pull from P failed: P's lease on the blocks ran out before D asked")
            return
        self._maybe_done(t)

    def _maybe_done(self, t: _Transfer) -> None:
        if t.done or t.d_start_ns is None or not t.ready or t.ready[-1][1] < t.num_tokens:
            return
        t.done = True
        loads = self.cost.blocks_to_load(t.num_tokens, t.d_hit_tokens)
        end_ns = modelled_end_ns(t.d_start_ns, self._arrivals(t, loads), self.link)
        t.stats = TransferStats.planned(t.d_hit_tokens, t.num_tokens - t.d_hit_tokens, tuple(map(len, loads)),
                                        tuple(c.bytes_per_block for c in self.cost.components),
                                        group_names=tuple(c.name for c in self.cost.components),
                                        d_tier_tokens=t.d_tier_tokens).pulled(t.d_start_ns, end_ns)
        if t.d_tier_load_ns is not None:
            t.stats = replace(t.stats, d_tier_load_start_ns=t.d_tier_load_ns[0], d_tier_loaded_ns=t.d_tier_load_ns[1])
        # After whatever runs now (P's step is still ending: its request is held only after it).
        self.loop.at(self.loop.now_ns, lambda: self._p_release(t))
        d_name = self._d_of[t.d_request_id]
        self.loop.at(end_ns, lambda: self._load_ended(d_name, t.d_request_id, None))

    def _arrivals(self, t: _Transfer, loads: tuple[range, ...]) -> list[tuple[int, int]]:
        """(ns, full-size bytes) of the blocks D asked for (`loads`), as P made them ready."""
        wanted = [(c, load.start) for c, load in zip(self.cost.components, loads)]  # (component, first block)
        arrivals, before = [], 0
        for at_ns, end in t.ready:
            ready = ready_blocks(end, t.num_tokens, self.block_size)  # blocks of the prompt P holds
            if ready <= before:
                continue
            nbytes = sum(max(0, ready - max(first, before)) * c.bytes_per_block for c, first in wanted)
            if nbytes:
                arrivals.append((max(at_ns, t.d_start_ns), nbytes))
            before = ready
        return arrivals

    def _p_release(self, t: _Transfer) -> None:
        if not t.p_released:
            t.p_released = True
            self._release(self._p_of.pop(t.p_request_id), {t.p_request_id})
            self._by_p.pop(t.p_request_id, None)

    def _p_finished(self, t: _Transfer) -> None:
        """P's request ended: its blocks wait for D, at most the lease."""
        def lease_over():
            if not t.done:
                t.expired = True
                self._p_release(t)
                if t.d_start_ns is not None:
                    self._fail(t, "KV pull from P failed: P's lease on the blocks ran out")
        self.loop.at(self.loop.now_ns + self.lease_ns, lease_over)

    def _fail(self, t: _Transfer, error: str) -> None:
        t.done = True
        n = len(self.cost.components)
        t.stats = TransferStats(blocks_per_group=(0,) * n, bytes_per_group=(0,) * n,
                                transfer_start_ns=t.d_start_ns or 0).failed(error, end_ns=self.loop.now_ns)
        self._load_ended(self._d_of[t.d_request_id], t.d_request_id, error)

    def _p_preempted(self, t: _Transfer) -> None:
        t.ready.clear()  # its blocks are reused: nothing of it is ready any more


class _ProducerHooks(KvHooks):
    def __init__(self, kv: VirtualKv):
        self.kv = kv

    def computed(self, req: SimRequest, start: int, end: int) -> None:
        t = self.kv._by_p.get(req.request_id)
        if t is not None:
            self.kv._p_computed(t, end)

    def finished(self, req: SimRequest) -> bool:
        t = self.kv._by_p.get(req.request_id)
        if t is None or not t.ready:
            return False  # nothing computed: no source, nothing for D
        if not t.p_released:
            self.kv._p_finished(t)
        return not t.p_released

    def preempted(self, req: SimRequest) -> None:
        t = self.kv._by_p.get(req.request_id)
        if t is not None:
            self.kv._p_preempted(t)


class _ConsumerHooks(KvHooks):
    def __init__(self, kv: VirtualKv):
        self.kv = kv

    def start_load(self, req: SimRequest) -> None:
        t = self.kv._by_d.get(req.request_id)
        assert t is not None, f"D loads {req.request_id}, which the router never announced (VirtualKv.expect)"
        self.kv._d_started(t, req.hit_tokens, req.tier_tokens, req.tier_load_ns)

    def cancel_load(self, req: SimRequest) -> None:
        raise AssertionError(f"{req.request_id} aborted while loading: the virtual clock has no aborts")



class _PrefillHooks(_ProducerHooks, _ConsumerHooks):
    """P: a producer for D, and a consumer of a peer's tier when its prefill reads the pool."""
