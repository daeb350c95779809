"""A KV tier's book (issue 29): which blocks a tier beyond the engine's device cache holds, keyed by
the block's hash and its KV-cache group, which of them a load is reading, and which go first when
the tier is full.

Sans-I/O: the book holds no bytes, owns no clock and no thread. Its owner (an instance's host tier,
or the simulated engine's) stores and frees the bytes as `keep` and `evict` say, passes `now_s` to
every call, and serialises the calls.

What it promises:
- `used_bytes` is the sum of the held blocks' bytes and never exceeds `capacity_bytes`.
- A block a lease holds (a load reading it) is never evicted; `keep` stores fewer blocks rather
  than evict one.
- Eviction order: blocks whose retention ran out (or never had one) first, least recently used
  (kept or matched) first, and of one prompt's blocks used together the last first (as vLLM frees
  a request's blocks, tail first: a prefix's head is worth more than its tail, which never hits
  without it); then retained blocks, the soonest to expire first. A retention is the
  request's hint (its session's next turn expected within so long), cut to `max_retention_s`.
- `match` finds a prompt's longest prefix held in every group it names: a hit is a run of whole
  blocks from the prompt's first, as the engine's own prefix cache counts one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

BlockKey = tuple[int, bytes]  # (KV-cache group, the block's hash)


@dataclass
class _Entry:
    nbytes: int
    retain_until_s: float = 0.0  # retained while now_s < this
    leases: int = 0  # loads reading it


@dataclass(frozen=True)
class Kept:
    """What `keep` did: the blocks the owner must now store, and those it must free first."""

    stored: tuple[BlockKey, ...] = ()
    evicted: tuple[BlockKey, ...] = ()
    refused: tuple[BlockKey, ...] = ()  # no room: every other block is leased (or bigger than the tier)


@dataclass
class TierBook:
    capacity_bytes: int
    max_retention_s: float = 0.0
    # Oldest use first; a block moves to the end when kept or matched again.
    _entries: OrderedDict[BlockKey, _Entry] = field(default_factory=OrderedDict)
    _leases: dict[int, tuple[BlockKey, ...]] = field(default_factory=dict)
    _lease_ids: itertools.count = field(default_factory=itertools.count)
    used_bytes: int = 0

    def __post_init__(self):
        if self.capacity_bytes < 0 or self.max_retention_s < 0:
            raise ValueError(f"a tier of {self.capacity_bytes} bytes, retention up to {self.max_retention_s} s: "
                             f"both must be >= 0")

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, blocks: Sequence[tuple[BlockKey, int]], now_s: float, retain_s: float = 0.0) -> Kept:
        """Hold these (key, bytes) blocks, in order (a prompt's, first block first): those already
        held are touched and their retention extended, new ones stored as room allows, evicting
        what the order above says. A block that finds no room is refused, and so is every block
        after it (a tier holding a block whose parent it lacks could never hit on it)."""
        until = now_s + min(max(retain_s, 0.0), self.max_retention_s)
        stored, evicted, refused = [], [], []
        earlier: set[BlockKey] = set()  # the prompt's blocks before this one: never evicted for it
        for i, (key, nbytes) in enumerate(blocks):
            if (entry := self._entries.get(key)) is not None:
                entry.retain_until_s = max(entry.retain_until_s, until)
                self._entries.move_to_end(key)  # (not evicted for the blocks after it; reordered below)
                earlier.add(key)
                continue
            freed = self._make_room(nbytes, now_s, protect=earlier)
            if freed is None:
                refused = [k for k, _ in blocks[i:] if k not in self._entries]
                break
            evicted += freed
            earlier.add(key)
            self._entries[key] = _Entry(nbytes, until)
            self.used_bytes += nbytes
            stored.append(key)
        self._used_tail_first([k for k, _ in blocks if k in self._entries])
        return Kept(tuple(stored), tuple(evicted), tuple(refused))

    def _used_tail_first(self, keys: Sequence[BlockKey]) -> None:
        """Mark a prompt's blocks used now, its first the most recently: evicted tail first."""
        for k in reversed(keys):
            self._entries.move_to_end(k)

    def match(self, prompt: Mapping[int, Sequence[bytes]]) -> int:
        """How many of the prompt's first blocks the tier holds in every group it names:
        `prompt[g]` is group g's block hashes in prompt order (a group with nothing to hold, as a
        window's blocks before its window, is left out by the caller). The blocks matched count as
        used now."""
        n = min((len(hashes) for hashes in prompt.values()), default=0)
        for i in range(n):
            if any((g, hashes[i]) not in self._entries for g, hashes in prompt.items()):
                n = i
                break
        self._used_tail_first([(g, hashes[i]) for i in range(n) for g, hashes in prompt.items()])
        return n

    def lease(self, keys: Sequence[BlockKey]) -> int:
        """Pin blocks a load is about to read (each held, or KeyError); `release` the id after."""
        missing = [k for k in keys if k not in self._entries]
        if missing:
            raise KeyError(f"the tier does not hold {len(missing)} of the {len(keys)} blocks to lease")
        for k in keys:
            self._entries[k].leases += 1
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = tuple(keys)
        return lease_id

    def release(self, lease_id: int) -> None:
        """End a lease (a second release of one id is a no-op: a load that failed and the
        cleanup after it may both release)."""
        for k in self._leases.pop(lease_id, ()):
            self._entries[k].leases -= 1

    def drop(self, keys: Sequence[BlockKey]) -> tuple[BlockKey, ...]:
        """Forget blocks whose bytes went bad or away (not leased ones); the ones dropped."""
        out = tuple(k for k in keys if (e := self._entries.get(k)) is not None and not e.leases)
        for k in out:
            self.used_bytes -= self._entries.pop(k).nbytes
        return out

    def clear(self) -> tuple[BlockKey, ...]:
        """Forget every block no lease holds (a cache reset); the ones forgotten."""
        return self.drop(list(self._entries))

    def _make_room(self, nbytes: int, now_s: float, protect: set[BlockKey]) -> list[BlockKey] | None:
        """Evict until `nbytes` fit; None (nothing evicted) if they cannot."""
        if nbytes > self.capacity_bytes:
            return None
        need = self.used_bytes + nbytes - self.capacity_bytes
        if need <= 0:
            return []
        victims, got, retained = [], 0, []
        for k, e in self._entries.items():  # LRU order, as held: stops as soon as there is room
            if e.leases or k in protect:
                continue
            if e.retain_until_s > now_s:
                retained.append((e.retain_until_s, k))
                continue
            victims.append(k)
            got += e.nbytes
            if got >= need:
                break
        if got < need:  # then the retained ones, the soonest to expire first
            for _, k in sorted(retained, key=lambda x: x[0]):
                victims.append(k)
                got += self._entries[k].nbytes
                if got >= need:
                    break
        if got < need:
            return None
        for k in victims:
            self.used_bytes -= self._entries.pop(k).nbytes
        return victims
