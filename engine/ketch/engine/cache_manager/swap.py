"""Host swap space: KV blocks evicted from the engine's device cache, kept in numbered slots.

The engine decides which block goes to which slot; this store only checks the indices and
copies. Its memory is allocated lazily (``np.empty`` of the whole capacity: pages nobody wrote
cost nothing), so a large ``--swap-space`` is free until it is used.
"""

from __future__ import annotations

import numpy as np

from ketch.engine.cache_manager.protocol import KVLayout

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
"""The numpy element a KV dtype is kept as in the segment and the swap slots. bfloat16 is copied
as raw 16-bit words: the cache manager never does arithmetic on KV data, so every copy is exact
and a slot holds exactly ``layout.block_bytes``."""


class SwapStore:
    """``slots`` block-sized buffers plus the set of slots that hold swapped-out data.

    A slot is *used* from the swap-out that fills it on: a swap-in copies it back but the slot
    keeps the block (the engine may swap it in again), until the engine reuses the slot.
    """

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        self.layout = layout
        self.slots = capacity_bytes // layout.block_bytes if capacity_bytes > 0 else 0
        self._store: np.ndarray | None = None
        self.used: set[int] = set()

    def _buffer(self) -> np.ndarray:
        if self._store is None:
            shape = (self.slots, *self.layout.block_shape)
            self._store = np.empty(shape, dtype=NUMPY_DTYPES[self.layout.dtype])
        return self._store

    def check(self, out: list[tuple[int, int]], into: list[tuple[int, int]]) -> str | None:
        """Why this swap cannot run (a bad block or slot index), or None."""
        num_blocks = self.layout.num_blocks
        if (out or into) and self.slots == 0:
            return "this cache manager has no swap space (--swap-space 0)"
        for kind, pairs, block_at in (("out", out, 0), ("into", into, 1)):
            for pair in pairs:
                block, slot = pair[block_at], pair[1 - block_at]
                if not 1 <= block < num_blocks:
                    return f"swap {kind}: device block {block} is outside [1, {num_blocks})"
                if not 0 <= slot < self.slots:
                    return f"swap {kind}: swap slot {slot} is outside [0, {self.slots})"
        return None

    def swap(
        self, kv: np.ndarray, out: list[tuple[int, int]], into: list[tuple[int, int]]
    ) -> str | None:
        """Copies outs (device -> slot) strictly before ins (slot -> device).

        Returns an error and copies nothing if any index is bad.
        """
        error = self.check(out, into)
        if error is not None:
            return error
        if not out and not into:
            return None
        store = self._buffer()
        for block, slot in out:
            store[slot] = kv[:, :, :, block]
            self.used.add(slot)
        for slot, block in into:
            kv[:, :, :, block] = store[slot]
        return None

    def reset(self) -> None:
        """Forgets every swapped-out block (the engine's index of them is gone)."""
        self.used.clear()
