"""Ketch compute kernels (fused attention and friends)."""
