"""The engine's KV segment as the cache manager sees it: mapping it, and checking block ids.

The worker keeps its KV cache in ``/dev/shm/<segment>``, laid out
``[num_layers, 2, kv_heads, num_blocks, block_size, head_dim]``; the cache manager maps the same
file read-write, so its copies land directly in the engine's cache. Block 0 is reserved by the
engine's block pool (the padding target), so valid device blocks are ``[1, num_blocks)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.reservations import Reservations
from ketch.engine.cache_manager.swap import NUMPY_DTYPES as _NUMPY_DTYPES
from ketch.engine.cache_manager.swap import SwapStore

SHM_DIR = Path("/dev/shm")


@dataclass
class Attachment:
    """The engine this cache manager serves: its id, its KV layout and the mapped segment."""

    engine_id: str
    layout: p.KVLayout
    kv: np.ndarray
    swap: SwapStore
    # What peers may write into, per request (decode role); a new engine starts with none.
    reservations: Reservations = field(default_factory=Reservations)


def map_segment(layout: p.KVLayout) -> np.ndarray:
    """Maps ``/dev/shm/<layout.segment>`` read-write; ValueError says what does not fit."""
    name = layout.segment
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"KV segment name {name!r} is not a shared-memory name")
    if layout.dtype not in _NUMPY_DTYPES:
        raise ValueError(f"KV dtype {layout.dtype!r} is not supported")
    dims = layout.shape
    if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
        raise ValueError(f"KV layout has a non-positive dimension: {dims}")
    path = SHM_DIR / name
    if not path.is_file():
        raise ValueError(f"KV segment {path} does not exist (is the engine's worker running?)")
    dtype = np.dtype(_NUMPY_DTYPES[layout.dtype])
    expected = int(np.prod(dims)) * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"KV segment {path} holds {actual} bytes; layout {dims} {layout.dtype} needs {expected}"
        )
    return np.memmap(path, dtype=dtype, mode="r+", shape=dims)


def bad_blocks(blocks: list[Any], num_blocks: int, what: str) -> str | None:
    for block in blocks:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block < num_blocks:
            return f"{what} {block!r} is outside [1, {num_blocks})"
    return None


def _rows(array: np.ndarray) -> np.ndarray:
    """``[L, 2, H, n, bs, hd]`` -> the view ``[L*2*H, n, bs*hd]`` (one row per layer/K-V/head)."""
    lay, kv, heads, n, bs, hd = array.shape
    return array.reshape(lay * kv * heads, n, bs * hd)


def runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(i, block, length)`` for each run of consecutive block ids starting at ``blocks[i]``."""
    out: list[tuple[int, int, int]] = []
    for i, block in enumerate(blocks):
        if out and out[-1][1] + out[-1][2] == block:
            start, first, length = out[-1]
            out[-1] = (start, first, length + 1)
        else:
            out.append((i, block, 1))
    return out


def gather(kv: np.ndarray, blocks: list[int], out: np.ndarray) -> np.ndarray:
    """``out[:, :, :, i] = kv[:, :, :, blocks[i]]`` into a C-contiguous ``out``; returns ``out``.

    One strided copy per run of consecutive blocks: about 4x faster than numpy's fancy indexing
    on the block axis (measured 3.4 ms against 14-20 ms for 16 scattered blocks of 1.6 MB).
    ``kv`` may be a slice of layers (``kv[lo:hi]``) with a matching ``out``.
    """
    src, dst = _rows(kv), _rows(out)
    for i, block, length in runs(blocks):
        dst[:, i : i + length] = src[:, block : block + length]
    return out


def scatter(kv: np.ndarray, blocks: list[int], data: np.ndarray) -> None:
    """``kv[:, :, :, blocks[i]] = data[:, :, :, i]``, one strided copy per run of blocks."""
    src, dst = _rows(data), _rows(kv)
    for i, block, length in runs(blocks):
        dst[:, block : block + length] = src[:, i : i + length]


PART_BYTES = 2 << 20
"""About how many bytes one part of a multi-part push holds (whole layers, at least one)."""


def layer_ranges(
    layout: p.KVLayout, num_blocks: int, part_bytes: int = PART_BYTES
) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` layer ranges a push of ``num_blocks`` blocks is sent in, in order."""
    layer_bytes = layout.block_bytes // layout.num_layers * num_blocks
    per_part = max(1, part_bytes // max(1, layer_bytes))
    return [
        (lo, min(lo + per_part, layout.num_layers)) for lo in range(0, layout.num_layers, per_part)
    ]
