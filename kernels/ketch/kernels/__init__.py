"""Ketch compute kernels, chosen once per process from the CPU's features.

``CpuKernels.select()`` reads the CPU's features (``cpu_features``) and picks, for each kernel,
the fastest implementation this CPU can run, logging the choice once; the model calls the
kernels through the object it was given, so a test can hand it the portable set on any machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ketch.kernels.cpu_features import CpuFeatures

if TYPE_CHECKING:
    from ketch.kernels.paged_attention import PagedAttention

logger = logging.getLogger(__name__)

RmsNorm = Callable[..., object]


@dataclass(frozen=True)
class CpuKernels:
    """The kernel implementations one model instance runs with."""

    rms_norm: RmsNorm
    rms_norm_name: str
    # The C++ paged-attention kernel for this CPU; None: the model's eager paddle path. Not yet
    # called by the model (issue 15 wires it in with the predictor backend).
    paged_attention: PagedAttention | None = None

    @classmethod
    def portable(cls) -> CpuKernels:
        """Plain paddle ops only: runs on every CPU paddle supports."""
        from ketch.kernels.rms_norm import rms_norm_portable

        return cls(rms_norm=rms_norm_portable, rms_norm_name="portable")

    @classmethod
    def select(cls, features: CpuFeatures | None = None, log: bool = True) -> CpuKernels:
        """The fastest kernels ``features`` (default: this machine's) allow."""
        from ketch.kernels.paged_attention import select_paged_attention
        from ketch.kernels.rms_norm import FUSED_OP, rms_norm_fused

        features = features or CpuFeatures.detect()
        kernels = cls.portable()
        if features.can_run(FUSED_OP):
            kernels = cls(rms_norm=rms_norm_fused, rms_norm_name="fused AVX-512 kernel")
        attention = select_paged_attention(features)
        kernels = cls(kernels.rms_norm, kernels.rms_norm_name, attention)
        if log:
            name, source = kernels.rms_norm_name, features.source
            logger.info("eager-path rms_norm: %s (CPU flags from %s)", name, source)
            logger.debug(
                "paged_attention: %s C++ kernel (not used by the model yet)", attention.isa
            )
        return kernels
