"""Rotary position embedding tables (default, linear and llama3 scaling)."""

from __future__ import annotations

import math

import numpy as np

from ketch.engine.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair rotation frequencies, in float32 as the reference implementation computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between is blended.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def cos_sin_tables(rope: RopeConfig, head_dim: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """[max_len, head_dim] cos and sin tables for the rotate-half convention."""
    inv_freq = inverse_frequencies(rope, head_dim)
    positions = np.arange(max_len, dtype=np.float32)
    freqs = np.outer(positions, inv_freq).astype(np.float32)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
