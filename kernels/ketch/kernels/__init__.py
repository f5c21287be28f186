"""Ketch compute kernels, chosen once per process from the CPU's features.

``CpuKernels.select()`` reads the CPU's features (``cpu_features``) and picks, for each kernel,
the fastest implementation this CPU can run, logging the choice once; the model calls the
kernels through the object it was given, so a test can hand it the portable set on any machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ketch.kernels.cpu_features import CpuFeatures

logger = logging.getLogger(__name__)

RmsNorm = Callable[..., object]


@dataclass(frozen=True)
class CpuKernels:
    """The kernel implementations one model instance runs with."""

    rms_norm: RmsNorm
    rms_norm_name: str

    @classmethod
    def portable(cls) -> CpuKernels:
        """Plain paddle ops only: runs on every CPU paddle supports."""
        from ketch.kernels.rms_norm import rms_norm_portable

        return cls(rms_norm=rms_norm_portable, rms_norm_name="portable")

    @classmethod
    def select(cls, features: CpuFeatures | None = None, log: bool = True) -> CpuKernels:
        """The fastest kernels ``features`` (default: this machine's) allow."""
        from ketch.kernels.rms_norm import FUSED_OP, rms_norm_fused

        features = features or CpuFeatures.detect()
        kernels = cls.portable()
        if features.can_run(FUSED_OP):
            kernels = cls(rms_norm=rms_norm_fused, rms_norm_name="fused AVX-512 kernel")
        if log:
            logger.info("rms_norm: %s (CPU flags from %s)", kernels.rms_norm_name, features.source)
        return kernels
