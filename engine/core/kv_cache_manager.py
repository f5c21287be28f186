"""Maps requests to KV blocks: prefix-cache lookup, slot allocation and release."""

from __future__ import annotations

from ketch.engine.core.block_pool import ROOT, UNCACHED, BlockKey, BlockPool
from ketch.engine.core.request import Request


class KVCacheManager:
    """The scheduler's only view of the KV cache: blocks, never tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)

    @property
    def usage(self) -> float:
        return self.pool.usage

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
        self, request: Request, num_new_tokens: int, computed: list[int] | None = None
    ) -> bool:
        """Gives the request room for ``num_new_tokens`` more tokens; False if out of blocks.

        ``computed`` are prefix-cache hits from ``get_computed_blocks`` for a request that holds
        no blocks yet; they are referenced and count as computed tokens.
        """
        computed = computed or []
        need = (
            (
                request.num_computed_tokens
                + len(computed) * self.block_size
                + num_new_tokens
                + self.block_size
                - 1
            )
            // self.block_size
            - len(request.block_ids)
            - len(computed)
        )
        pool = self.pool
        reclaimable = sum(1 for b in computed if pool.ref_counts[b] == 0)
        if need > pool.num_free_blocks - reclaimable:
            return False
        if computed:
            pool.touch(computed)
            request.block_ids.extend(computed)
            request.num_computed_tokens += len(computed) * self.block_size
            request.num_registered_blocks = len(computed)
            request.cache_parent = pool.key(computed[-1])
        if need > 0:
            request.block_ids.extend(pool.allocate(need))
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
                request.block_ids[i], hashes[i], parent, tuple(tokens[i * bs : (i + 1) * bs])
            )
        request.num_registered_blocks = num_full
        request.cache_parent = parent

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first so shared prefixes are evicted last."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_registered_blocks = 0
        request.cache_parent = ROOT

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.token_ids
        prev = hashes[-1] if hashes else 0
        for i in range(len(hashes), num_blocks):
            prev = hash((prev, *tokens[i * bs : (i + 1) * bs]))
            hashes.append(prev)
        return hashes
