"""Maps requests to KV blocks: prefix-cache lookup, slot allocation and release.

With a cache manager attached (``attach_swap``), cached blocks the pool evicts are copied to host
swap slots, and a prefix that continues past the device cache's hits is looked up there and
copied back into freshly allocated blocks instead of being recomputed (``HostCache``). The
copies are batched: evictions queue swap-outs, and ``flush`` sends them (with any swap-ins, outs
first) before the worker next touches the cache.

Block hashes are a keyed chain: a block's is BLAKE2b (16 bytes, keyed with a random key drawn
per manager, so per engine process) over its parent's hash and its token ids, so it stands for
the whole prefix up to the block's end. Nobody without the key can steer two prefixes to one
hash, which the host tier relies on: it finds a block by its hash (and checks the parent's hash
and its tokens), not by the identity of a cached parent as the device pool does. Python's
``hash`` of a tuple, used before, is not keyed and each round is invertible: a client could build
a prompt whose chain collides with another user's prefix and have its KV served to that user
from the host tier. The hashes never leave the process (the cache manager sees slots only), so
the key is never shared; about 3 microseconds a 64-token block, once per block of a request.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from array import array
from typing import Protocol

from ketch.engine.core.block_pool import ROOT, ROOT_HASH, UNCACHED, BlockHash, BlockKey, BlockPool
from ketch.engine.core.host_cache import HostCache
from ketch.engine.core.request import Request

logger = logging.getLogger(__name__)


class SwapExecutor(Protocol):
    """Whatever copies blocks between the device cache and host swap slots (the cache manager)."""

    def swap(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> bool:
        """Copies (block -> slot) for ``out``, then (slot -> block) for ``into``; False if it
        could not (nothing may then be assumed copied)."""
        ...


class KVCacheManager:
    """The scheduler's only view of the KV cache: blocks, never tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host = HostCache(0)
        self._swapper: SwapExecutor | None = None
        self._pending_out: list[tuple[int, int, BlockHash]] = []  # (block, slot, block hash)
        # Copied per block: the key's setup is done once.
        self._hasher = hashlib.blake2b(key=secrets.token_bytes(32), digest_size=16)
        self.num_swapped_in = 0
        self.num_swapped_out = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ---- the host swap tier ----

    def attach_swap(self, swapper: SwapExecutor, num_slots: int) -> None:
        """Starts keeping evicted prefix blocks in ``num_slots`` host slots via ``swapper``."""
        self._pending_out.clear()
        self.host.reset(num_slots if self.enable_caching else 0)
        self._swapper = swapper if self.host.capacity else None
        self.pool.on_evict = self._on_evict if self._swapper else None

    def detach_swap(self) -> None:
        """The cache manager is gone: its swap content with it."""
        self._swapper = None
        self.pool.on_evict = None
        self._pending_out.clear()
        self.host.reset(0)

    def _on_evict(
        self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash, tokens: tuple
    ) -> None:
        slot = self.host.store(block_hash, parent_hash, tokens)
        if slot is not None:
            self._pending_out.append((block_id, slot, block_hash))

    def get_host_hits(self, request: Request, start: int) -> list[int]:
        """Swap slots holding the request's prefix blocks from block ``start`` on (pinned until
        the next ``flush``). Like the device cache, never the block of the last token."""
        if self._swapper is None or not len(self.host):
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        tokens = request.token_ids
        slots: list[int] = []
        for i in range(start, max_blocks):
            parent_hash = hashes[i - 1] if i else ROOT_HASH
            slot = self.host.lookup(hashes[i], parent_hash, tuple(tokens[i * bs : (i + 1) * bs]))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def flush(self, into: list[tuple[int, int]] | None = None) -> bool:
        """Runs queued swap-outs and the given swap-ins (slot -> block); True if all were done."""
        into = into or []
        pending, self._pending_out = self._pending_out, []
        if not pending and not into:
            return True
        ok = self._swapper is not None and self._swapper.swap(
            [(block, slot) for block, slot, _ in pending], into
        )
        if ok:
            self.num_swapped_out += len(pending)
            self.num_swapped_in += len(into)
        else:
            for _, _, block_hash in pending:
                self.host.drop(block_hash)
        self.host.unpin_all()
        return ok

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens (not yet referenced).

        The block holding the last token is never reused, so that token is always computed and
        its logits exist to sample from.
        """
        if not self.enable_caching:
            return []
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        tokens = request.token_ids
        pool = self.pool
        parent: BlockKey = ROOT
        found: list[int] = []
        for i in range(max_blocks):
            block_id = pool.lookup(hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            found.append(block_id)
            parent = pool.key(block_id)
        return found

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: list[int] | None = None,
        host_slots: list[int] | None = None,
    ) -> bool:
        """Gives the request room for ``num_new_tokens`` more tokens; False if out of blocks.

        ``computed`` are prefix-cache hits from ``get_computed_blocks`` for a request that holds
        no blocks yet; they are referenced and count as computed tokens. ``host_slots`` (from
        ``get_host_hits``) are the blocks after those: they get fresh blocks, are copied back
        from the host and then count as computed too (if the copy fails, they are computed).
        """
        computed = computed or []
        host_slots = host_slots or []
        bs = self.block_size
        num_hits = len(computed) + len(host_slots)
        need = (
            (request.num_computed_tokens + num_hits * bs + num_new_tokens + bs - 1) // bs
            - len(request.block_ids)
            - len(computed)
        )
        pool = self.pool
        reclaimable = sum(1 for b in computed if pool.ref_counts[b] == 0)
        if need > pool.num_free_blocks - reclaimable:
            self.host.unpin_all()
            return False
        if computed:
            pool.touch(computed)
            request.block_ids.extend(computed)
            request.num_computed_tokens += len(computed) * self.block_size
            request.num_registered_blocks = len(computed)
            request.cache_parent = pool.key(computed[-1])
        if need > 0:
            fresh = pool.allocate(need)
            request.block_ids.extend(fresh)
            if host_slots and self.flush(list(zip(host_slots, fresh, strict=False))):
                request.num_computed_tokens += len(host_slots) * bs
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Registers blocks that became full of computed tokens in the prefix cache."""
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        start = request.num_registered_blocks
        if num_full <= start or not self.enable_caching:
            return
        hashes = self._block_hashes(request, num_full)
        tokens = request.token_ids
        parent = request.cache_parent
        pool = self.pool
        for i in range(start, num_full):
            if parent == UNCACHED:
                break
            parent = pool.cache(
                request.block_ids[i],
                hashes[i],
                parent,
                tuple(tokens[i * bs : (i + 1) * bs]),
                hashes[i - 1] if i else ROOT_HASH,
            )
        request.num_registered_blocks = num_full
        request.cache_parent = parent

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first so shared prefixes are evicted last."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_registered_blocks = 0
        request.cache_parent = ROOT

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first ``num_blocks`` blocks (kept on it)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.token_ids
        prev = hashes[-1] if hashes else ROOT_HASH
        hasher = self._hasher
        for i in range(len(hashes), num_blocks):
            h = hasher.copy()
            h.update(prev)
            h.update(array("q", tokens[i * bs : (i + 1) * bs]))  # token ids: 0 <= id < vocab
            prev = h.digest()
            hashes.append(prev)
        return hashes
