"""The paged KV cache's block pool: O(1) allocate/free, reference counts, prefix cache.

Block 0 is reserved (the padding target of block tables) and never handed out. A block whose
reference count drops to zero goes to the tail of the free queue but keeps its contents and its
prefix-cache entry; it is only forgotten when the queue hands it out again (lazy LRU eviction).
A prefix-cache hit on such a block takes it back out of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

BlockKey = tuple[int, int]
"""(block id, generation): the identity of one cached block content."""

ROOT: BlockKey = (0, 0)
"""The parent of a sequence's first block."""

UNCACHED: BlockKey = (-1, -1)
"""A parent that is not in the cache: its children can never be found, so are not cached."""

BlockHash = bytes
"""A block's chained hash: a keyed digest of its tokens and its parent's hash
(``KVCacheManager._block_hashes``), so of the whole prefix up to the block's end."""

ROOT_HASH: BlockHash = b""
"""The parent hash of a sequence's first block."""

EvictHook = Callable[[int, BlockHash, BlockHash, tuple[int, ...]], None]
"""Called as (block id, block hash, parent's block hash, tokens) just before a cached block's
content is forgotten, while the block still holds it (the host swap tier keeps a copy)."""


class BlockPool:
    """Owns every KV block's reference count and prefix-cache identity."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (oldest first). dict order gives O(1) append,
        # pop-front and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._hash_of: dict[int, BlockHash] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._parent_of: dict[int, BlockKey] = {}
        self._parent_hash_of: dict[int, BlockHash] = {}
        self._cached: dict[BlockHash, int] = {}
        # Bumped on every eviction, so (block id, generation) names one content forever and a
        # child can name its parent exactly, even after the parent's block is reused.
        self._generation = [0] * num_blocks
        self.num_evictions = 0
        self.on_evict: EvictHook | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` blocks (evicting cached ones if needed); the caller checked there are."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = []
        pop = self._free.popitem
        for _ in range(n):
            block_id = pop(last=False)[0]
            if block_id in self._hash_of:
                self._evict(block_id)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block; unreferenced ones become free (and evictable)."""
        ref_counts = self.ref_counts
        free = self._free
        for block_id in block_ids:
            count = ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block_id} freed more often than allocated")
            ref_counts[block_id] = count
            if count == 0:
                free[block_id] = None
                if block_id not in self._hash_of:
                    # Blocks without cached content are reused first.
                    free.move_to_end(block_id, last=False)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on cached blocks found by ``lookup``."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def key(self, block_id: int) -> BlockKey:
        return (block_id, self._generation[block_id])

    def lookup(
        self, block_hash: BlockHash, parent: BlockKey, tokens: tuple[int, ...]
    ) -> int | None:
        """Finds the cached block with this hash whose parent and tokens match exactly.

        The hash only narrows the search; the token and parent comparison makes a hit exact.
        """
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self._parent_of[block_id] != parent or self._tokens_of[block_id] != tokens:
            return None
        return block_id

    def cache(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent: BlockKey,
        tokens: tuple[int, ...],
        parent_hash: BlockHash = ROOT_HASH,
    ) -> BlockKey:
        """Registers a full, computed block; returns the identity under which it is cached.

        If the same content is already cached in another block (two requests computed it at
        once), that block stays the canonical one and its identity is returned.
        """
        if not self.enable_caching or parent == UNCACHED:
            return UNCACHED
        existing = self.lookup(block_hash, parent, tokens)
        if existing is not None:
            return self.key(existing)
        if block_id in self._hash_of:
            return UNCACHED  # already cached under another identity: leave this chain
        # A stale entry (say, a child of an evicted parent) under the same hash is replaced;
        # _evict only removes a mapping that still points at the evicted block.
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = tokens
        self._parent_of[block_id] = parent
        self._parent_hash_of[block_id] = parent_hash
        self._cached[block_hash] = block_id
        return self.key(block_id)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (nothing goes to the host swap tier)."""
        hook, self.on_evict = self.on_evict, None
        for block_id in list(self._hash_of):
            self._evict(block_id)
        self.on_evict = hook

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id)
        tokens = self._tokens_of.pop(block_id)
        del self._parent_of[block_id]
        parent_hash = self._parent_hash_of.pop(block_id)
        if self.on_evict is not None:
            self.on_evict(block_id, block_hash, parent_hash, tokens)
        if self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]
        self._generation[block_id] += 1
        self.num_evictions += 1

    def check_integrity(self, owners: Iterable[Sequence[int]]) -> None:
        """Raises ``BlockAccountingError`` unless the pool agrees with ``owners`` (every holder
        of a block reference, one list each): each block's reference count is its number of
        holders, the free queue holds exactly the unreferenced blocks (so no holder holds a
        free block, and free + held is every block but 0), and the prefix-cache maps agree."""
        expected = [0] * self.num_blocks
        for block_ids in owners:
            for block_id in block_ids:
                if not 0 <= block_id < self.num_blocks:
                    raise BlockAccountingError(f"a holder holds block {block_id}: no such block")
                expected[block_id] += 1
        if expected[0]:
            raise BlockAccountingError("reserved block 0 is held")
        if expected != self.ref_counts:
            bad = [(b, self.ref_counts[b], expected[b]) for b in range(self.num_blocks)
                   if expected[b] != self.ref_counts[b]]  # fmt: skip
            raise BlockAccountingError(
                f"{len(bad)} KV blocks' reference counts differ from their holders "
                f"(block, count, holders): {bad[:10]}"
            )
        held_free = [b for b in self._free if expected[b]]
        if held_free:
            raise BlockAccountingError(f"held blocks are in the free queue: {held_free[:10]}")
        if len(self._free) + sum(1 for c in expected if c) != self.num_blocks - 1:
            raise BlockAccountingError(
                f"{len(self._free)} free and {sum(1 for c in expected if c)} held blocks of "
                f"{self.num_blocks - 1}: some are neither, or block 0 is free"
            )
        self._check_prefix_cache()

    def _check_prefix_cache(self) -> None:
        """The cached blocks' maps name the same blocks, and every hash in ``_cached`` points
        at a block cached under that hash."""
        cached = set(self._hash_of)
        maps = (self._tokens_of, self._parent_of, self._parent_hash_of)
        if any(set(m) != cached for m in maps) or 0 in cached:
            raise BlockAccountingError("the prefix cache's per-block maps disagree")
        wrong = [b for h, b in self._cached.items() if self._hash_of.get(b) != h]
        if wrong:
            raise BlockAccountingError(f"prefix-cache entries point at other content: {wrong[:10]}")


class BlockAccountingError(AssertionError):
    """The KV blocks' accounting is wrong: a bug (a leak, a block used twice, a stale cache
    entry), never a client's doing. ``Scheduler.check_integrity`` raises it."""
