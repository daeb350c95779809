"""An instance's host tier, scheduler side (issue 29): what the connector's scheduler side
(transfer/connector.py) asks of its tier, and the orders it gives its worker.

The tier is write-through: a request that ends hands its computed prompt blocks to the tier's book
(transfer/tier_book.py), which keeps what room allows; the worker copies them out of the device
cache (transfer/host_tier.py) before vLLM frees them. A later request whose prefix the device
cache lost but the tier holds loads those blocks back into blocks vLLM allocated for it, in the
step that schedules it (a synchronous load, as vLLM's scheduler calls it), and computes the rest.

The worker carries out `take_orders()` in order, so an order never reads a block a later one
evicted; a lease pins the blocks a load reads from its lookup until its order is given.

What the tier holds is published as KV cache events with medium "CPU" (`take_events()`, which
the connector hands vLLM to publish beside the device cache's): the router's prefix index counts
a tier's blocks apart from the device's (router/prefix_index.py).

Keys are (KV-cache group, vLLM's block hash), as vLLM's OffloadingConnector keys its blocks: one
prompt block's hash names its KV in every group. A full-attention (or compressed) group keeps and
loads every block of a prompt's prefix; a sliding-window group (Gemma3, gpt-oss) only the blocks its
window covers, as vLLM's own cache does: the tier keeps what vLLM had not yet freed when the request
ended (out-of-window positions hold vLLM's null block), and a hit of E tokens needs the blocks of
tokens [E - window + 1, E) (proto/kv_groups.py), which vLLM then allocates, and no others.

Groups may differ in block size (DeepSeek-V4: 256, 64, 8 and 4 tokens). vLLM then hashes a prompt
in blocks of their greatest common divisor (`Request.block_hashes`), names a group's block by the
hash of the prefix it ends (BlockPool's `_get_partial_block_hash`), and counts hits in whole units
of their least common multiple (the scheduler's block size); the tier does the same (`_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.proto.handle import MAX_RETENTION_S, RETAIN_KEY
from pdcluster.proto.kv_event_wire import HOST_MEDIUM, BlockRemoved, BlockStored
from pdcluster.proto.kv_groups import block_hash_index, cut_to_windows, hash_block_size, hit_unit, window_blocks
from pdcluster.transfer.groups import GroupInfo
from pdcluster.transfer.paged_kv import block_runs
from pdcluster.transfer.plan import NULL_BLOCK_ID
from pdcluster.transfer.tier_book import BlockKey, TierBook

if TYPE_CHECKING:
    from vllm.v1.request import Request


class TierUnsupported(ValueError):
    """A host tier asked for where it cannot work yet; the message says why."""


@dataclass(frozen=True)
class TierCopy:
    """One order to the worker: copy `group`'s blocks between the device cache and the tier.
    load: tier -> device blocks `block_ids`; store: device blocks -> tier; evict: free the keys
    (block_ids empty)."""

    op: str  # "store" | "load" | "evict"
    group: int
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...] = ()
    request_id: str = ""

    @property
    def keys(self) -> list[BlockKey]:
        return [(self.group, h) for h in self.hashes]


@dataclass
class TierOrders:
    copies: list[TierCopy] = field(default_factory=list)  # in the order decided: carry them out in it
    # Requests whose blocks vLLM frees once the worker stored them (reported as finished_sending).
    free_after: list[str] = field(default_factory=list)


class TierScheduler:
    def __init__(self, groups: Sequence[GroupInfo], capacity_bytes: int, max_retention_s: float = MAX_RETENTION_S):
        odd = [g for g in groups if g.kind not in ("full_attention", "compressed", "sliding_window")]
        if odd:
            raise TierUnsupported(
                f"a host KV tier keeps full-attention, compressed and sliding-window groups; this model has "
                f"{', '.join(f'group {g.index}: {g.name}' for g in odd)}: set host_tier_gib only for such models")
        sizes = [g.block_size for g in groups]
        self.block_size = hit_unit(sizes)  # a hit is whole units of this many tokens (vLLM's scheduler block size)
        self.hash_block_size = hash_block_size(sizes)  # tokens per entry of Request.block_hashes
        self._sizes = {g.index: g.block_size for g in groups}
        self._groups = tuple(g.index for g in groups)
        self._full = tuple(g.index for g in groups if g.kind != "sliding_window")
        self._windows = {g.index: g.window for g in groups if g.kind == "sliding_window"}  # group -> tokens
        self._block_bytes = {g.index: g.page_bytes for g in groups}
        self.book = TierBook(capacity_bytes, max_retention_s)
        self._orders = TierOrders()
        self._events: list[BlockStored | BlockRemoved] = []  # for the router, until taken
        self._leases: list[int] = []  # loads planned since the last orders were taken
        self._first: dict[str, tuple[int, int]] = {}  # request -> its last lookup's first block and tokens
        # Invariant: a request is here from the step its tier hit was allocated until it ends, with
        # the tokens that hit came to (the report's tier hit).
        self.hit_tokens: dict[str, int] = {}
        # Requests whose tier load failed, with the tokens it was to give: vLLM counted them as
        # cached when it scheduled them, and then computed them (or ended the request).
        self.failed_tokens: dict[str, int] = {}
        # Requests whose prompt is still being computed here, from their allocation (`track`; window
        # groups: their steps' hit boundaries are kept as they pass, `stepped`); what the last step passed.
        self._prefilling: dict[str, Request] = {}
        self._written: list[tuple[Request, list[tuple[int, int, int]]]] = []

    def _key(self, hashes: Sequence[bytes], group: int, i: int) -> bytes:
        """Group `group`'s block `i`: the hash of the prompt up to its end (vLLM's name for it)."""
        return hashes[block_hash_index(i, self._sizes[group], self.hash_block_size)]

    def _keys(self, hashes: Sequence[bytes], group: int, blocks: range) -> list[bytes]:
        return [self._key(hashes, group, i) for i in blocks]

    def lookup(self, request: Request, num_computed_tokens: int, computed_to: int = 0) -> int:
        """Tokens past the device cache's hit (`num_computed_tokens`, whole units) the tier holds:
        every full-attention group's blocks from the hit on; every window group's blocks among
        them that the window before `computed_to` covers (D pulling the rest from P: the prompt's
        end; else the tier hit's own end). At least one prompt token is left to compute, as vLLM's
        own cache leaves."""
        unit, hashes, start = self.block_size, request.block_hashes, num_computed_tokens
        last = min(len(hashes) * self.hash_block_size, request.num_tokens - 1) // unit * unit
        n = max(0, (last - start) // unit)
        # The book's run, counted as used now (not the next blocks a keep evicts), per block size.
        for size in sorted({self._sizes[g] for g in self._full}):
            run = self.book.match({g: self._keys(hashes, g, range(start // size, last // size))
                                   for g in self._full if self._sizes[g] == size})
            n = min(n, run * size // unit)
        n = cut_to_windows(n, start, unit, [(g, w, self._sizes[g]) for g, w in self._windows.items()],
                           lambda g, i: (g, self._key(hashes, g, i)) in self.book, computed_to)
        if n:
            self.book.match({g: self._keys(hashes, g, window_blocks(start, start + n * unit, self._sizes[g], window,
                                                                    computed_to))
                             for g, window in self._windows.items()})
        tokens = n * unit
        self._first[request.request_id] = start, tokens
        return tokens

    def lookup_taken(self, request: Request) -> int:
        """The tokens the last `lookup` of the request found (D: its tier's share of a load)."""
        return self._first.get(request.request_id, (0, 0))[1]

    def allocated(self, request: Request, block_ids: Sequence[Sequence[int]], num_tier_tokens: int) -> int:
        """vLLM allocated the request's blocks (`block_ids` per group, its whole table) with
        `num_tier_tokens` of the last lookup's from the tier: order their load. The token the tier's
        hit ends at (tokens from it on are computed, or pulled from P; 0: no hit)."""
        start, _ = self._first.pop(request.request_id, (None, 0))
        if num_tier_tokens <= 0 or start is None:
            self.hit_tokens.pop(request.request_id, None)  # (a preempted request's earlier hit is void)
            return 0
        end = start + num_tier_tokens
        loads = []  # per group: the positions vLLM allocated a block for (a window's: in the window)
        for g in self._groups:
            size = self._sizes[g]
            at = [i for i in range(start // size, end // size) if block_ids[g][i] != NULL_BLOCK_ID]
            loads.append(TierCopy("load", g, tuple(self._key(request.block_hashes, g, i) for i in at),
                                  tuple(block_ids[g][i] for i in at), request.request_id))
        # (A block the lookup did not check, were vLLM to allocate one, is not leased: its load
        # fails and the tokens are computed, or the request ends, as on_failure says.)
        self._leases.append(self.book.lease([k for c in loads for k in c.keys if k in self.book]))
        self._orders.copies += [c for c in loads if c.hashes]
        self.hit_tokens[request.request_id] = num_tier_tokens
        return end

    def finished(self, request: Request, block_ids: Sequence[Sequence[int]], now_s: float, free_after: bool) -> bool:
        """The request ended: keep its computed prompt blocks (retained as its hint asks). True
        when the worker must store some before vLLM frees them; with `free_after` the worker then
        reports the request (the caller holds the blocks no other way)."""
        retain_s = _retain_s(request)
        self.forget(request.request_id)
        tokens = min(len(request.block_hashes) * self.hash_block_size, request.num_computed_tokens,
                     request.num_prompt_tokens, *(len(block_ids[g]) * self._sizes[g] for g in self._groups))
        # A window group's blocks vLLM already freed (its null block in their place) were kept as
        # the prefill passed them, those a hit needs (`stepped`).
        if not self._keep(request, [(g, i, block_ids[g][i]) for g in self._groups
                                    for i in range(tokens // self._sizes[g]) if block_ids[g][i] != NULL_BLOCK_ID],
                          now_s, retain_s):
            return False
        if free_after:
            self._orders.free_after.append(request.request_id)
        return True

    def track(self, request: Request) -> None:
        """vLLM allocated the request's blocks: its steps may pass hit boundaries (`stepped`) until
        its prompt is computed or it ends."""
        if self._windows and request.num_computed_tokens < request.num_prompt_tokens:
            self._prefilling[request.request_id] = request

    def prefilling(self, request_id: str) -> bool:
        """The request's prompt is still being computed here (its steps may pass hit boundaries)."""
        return request_id in self._prefilling

    def stepped(self, request_id: str, num_scheduled: int, block_ids: Sequence[Sequence[int]]) -> None:
        """A step computes `num_scheduled` more of the request's tokens, in these blocks (its whole
        table, per group): each window group's blocks that a hit ending at a unit boundary the step
        passes needs are kept once the step has written them (`written`, at the next step's orders),
        as vLLM's own cache keeps them, before vLLM frees them as the window slides on."""
        request = self._prefilling.get(request_id)
        if request is None:
            return
        start, unit = request.num_computed_tokens, self.block_size  # (vLLM advances it after this step)
        end = min(start + num_scheduled, request.num_prompt_tokens, len(request.block_hashes) * self.hash_block_size)
        tails = {(g, i) for g, window in self._windows.items()
                 for boundary in range((start // unit + 1) * unit, end + 1, unit)
                 for i in window_blocks(0, boundary, self._sizes[g], window)}
        blocks = [(g, i, block_ids[g][i]) for g, i in tails if i < len(block_ids[g]) and block_ids[g][i] != NULL_BLOCK_ID]
        if blocks:
            self._written.append((request, blocks))
        if start + num_scheduled >= request.num_prompt_tokens:
            del self._prefilling[request_id]

    def written(self, now_s: float) -> None:
        """The last step ran: keep the window blocks its `stepped` requests passed. Their stores go
        first in the next orders, before a load there writes a block vLLM has since freed and reused."""
        written, self._written = self._written, []
        if not written:
            return
        later, self._orders.copies = self._orders.copies, []
        for request, blocks in written:
            self._keep(request, blocks, now_s, _retain_s(request))
        self._orders.copies += later

    def _keep(self, request: Request, blocks: Sequence[tuple[int, int, int]], now_s: float, retain_s: float) -> bool:
        """Hold these (group, block, device block id) of the request's prompt, in the order of the
        prefix each ends (the book refuses the rest after a block that finds no room); order the
        stores of those newly held and announce them. True: some are to be stored."""
        hashes = request.block_hashes
        blocks = sorted(blocks, key=lambda b: ((b[1] + 1) * self._sizes[b[0]], b[0], b[1]))
        where = {(g, self._key(hashes, g, i)): (i, block_id) for g, i, block_id in blocks}
        kept = self.book.keep([(key, self._block_bytes[key[0]]) for key in where], now_s, retain_s)
        self._order_evictions(kept.evicted)
        for g in self._groups:
            if not (stored := [key for key in kept.stored if key[0] == g]):
                continue
            self._orders.copies.append(TierCopy("store", g, tuple(h for _, h in stored),
                                                tuple(where[key][1] for key in stored), request.request_id))
            if _plain(request):
                self._events += self._stored_events(request, g, sorted(where[key][0] for key in stored))
        return bool(kept.stored)

    def _order_evictions(self, keys: Sequence[BlockKey]) -> None:
        by_group: dict[int, list[bytes]] = {}
        for g, h in keys:
            by_group.setdefault(g, []).append(h)
        self._orders.copies += [TierCopy("evict", g, tuple(hs)) for g, hs in by_group.items()]
        self._events += [BlockRemoved(tuple(hs), g, HOST_MEDIUM) for g, hs in by_group.items()]

    def _stored_events(self, request: Request, group: int, indices: Sequence[int]) -> list[BlockStored]:
        """One event per run of consecutive blocks newly kept, as vLLM's block pool announces its
        own: each names its first block's parent, so the router can place it in the prompt's chain."""
        bs, hashes = self._sizes[group], request.block_hashes
        return [BlockStored(self._keys(hashes, group, range(first, first + n)),
                            self._key(hashes, group, first - 1) if first else None,
                            request.all_token_ids[first * bs:(first + n) * bs], bs, group, HOST_MEDIUM)
                for first, n in block_runs(indices)]

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """What the tier stored and evicted since the last call, for vLLM to publish."""
        out, self._events = self._events, []
        return out

    def forget(self, request_id: str) -> None:
        """The request ended without handing its blocks to the tier."""
        self.hit_tokens.pop(request_id, None)
        self.failed_tokens.pop(request_id, None)
        self._first.pop(request_id, None)
        self._prefilling.pop(request_id, None)

    def load_failed(self, request_id: str) -> None:
        """The worker could not load the request's tier hit: it counts as computed, not as a hit."""
        if tokens := self.hit_tokens.pop(request_id, 0):
            self.failed_tokens[request_id] = self.failed_tokens.get(request_id, 0) + tokens

    def reset(self) -> bool:
        """Empty the tier (vLLM's reset_prefix_cache with reset_connector): the worker frees the
        bytes with the next orders. False if a load still holds blocks."""
        self._order_evictions(self.book.clear())
        return len(self.book) == 0

    def lost(self, keys: Sequence[BlockKey]) -> None:
        """The worker found no bytes for these keys (a load failed): forget them."""
        self._order_evictions(self.book.drop(keys))  # (the worker's evict of them is a no-op)

    def take_orders(self) -> TierOrders:
        for lease in self._leases:  # the worker reads them before any later order evicts one
            self.book.release(lease)
        self._leases = []
        out, self._orders = self._orders, TierOrders()
        return out


def _retain_s(request: Request) -> float:
    """The request's retention hint (proto/handle.py RETAIN_KEY), 0 without one."""
    return float((getattr(request, "kv_transfer_params", None) or {}).get(RETAIN_KEY, 0.0))


def _plain(request: Request) -> bool:
    """A prompt whose block hashes cover its tokens alone: the router's chain can place its blocks
    (a LoRA's or a cache salt's hashes cover more, which the router does not hash)."""
    return getattr(request, "lora_request", None) is None and getattr(request, "cache_salt", None) is None
