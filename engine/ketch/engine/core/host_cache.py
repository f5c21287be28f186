"""The engine's index of the host swap tier: which prefix-cache blocks the cache manager holds.

When the block pool forgets a cached block to reuse it, the block's content is copied to a host
swap slot instead of being lost (``on_evict``); a later request whose prefix continues past the
device cache's hits finds the rest here and has it copied back instead of recomputed. The engine
decides every slot; the cache manager (``ketch cache-manager``) only copies.

Entries are keyed by the block's chained hash and checked against its tokens and its parent's
chained hash. The chain is a keyed 128-bit BLAKE2b (``KVCacheManager._block_hashes``), so the
hash stands for the whole prefix: a hit is the exact prefix, and no client can construct a
prompt whose chain lands on another's entry (the device pool checks the parent's identity
instead; this tier cannot, as the parent's block may be long gone).
Slots are reused least recently used first. Slots that a pending swap-in will read are pinned
until the copy is done, so an eviction in the same step cannot overwrite them first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ketch.engine.core.block_pool import BlockHash


@dataclass
class _Entry:
    slot: int
    parent_hash: BlockHash
    tokens: tuple[int, ...]


class HostCache:
    """Chained block hash -> swap slot, LRU, with pinning; capacity 0 means no swap tier."""

    def __init__(self, capacity: int = 0) -> None:
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._free: list[int] = []
        self._pinned: set[int] = set()
        self.capacity = 0
        self.reset(capacity)

    def reset(self, capacity: int) -> None:
        """Forgets everything (the cache manager changed or went away) and sets the capacity."""
        self.capacity = max(0, capacity)
        self._entries.clear()
        self._pinned.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash, tokens: tuple[int, ...]
    ) -> int | None:
        """The slot holding this exact block, pinned and marked recently used; or None."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.parent_hash != parent_hash or entry.tokens != tokens:
            return None
        self._entries.move_to_end(block_hash)
        self._pinned.add(entry.slot)
        return entry.slot

    def store(
        self, block_hash: BlockHash, parent_hash: BlockHash, tokens: tuple[int, ...]
    ) -> int | None:
        """A slot to copy this block into (evicting the least recently used entry if full);
        None if there is no room (no swap tier, or every slot pinned)."""
        old = self._entries.pop(block_hash, None)
        if old is not None:
            if old.slot in self._pinned:  # being read right now: keep it, skip the copy
                self._entries[block_hash] = old
                return None
            self._free.append(old.slot)
        if not self._free and not self._evict_one():
            return None
        slot = self._free.pop()
        self._entries[block_hash] = _Entry(slot, parent_hash, tokens)
        return slot

    def unpin_all(self) -> None:
        self._pinned.clear()

    def drop(self, block_hash: BlockHash) -> None:
        """Forgets an entry whose copy failed."""
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self._pinned.discard(entry.slot)
            self._free.append(entry.slot)

    def _evict_one(self) -> bool:
        for block_hash, entry in self._entries.items():
            if entry.slot not in self._pinned:
                del self._entries[block_hash]
                self._free.append(entry.slot)
                return True
        return False
