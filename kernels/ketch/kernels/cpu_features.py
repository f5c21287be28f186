"""Which instruction sets this process may use, and which paddle ops need which.

Machines of one kind differ: some x86-64 CPUs have AVX-512, many only AVX2. Some paddle CPU
kernels are compiled for one instruction set with no runtime dispatch and kill the process with
SIGILL elsewhere, so the engine picks an implementation from the CPU's features once, at start-up,
and never by trying.

The features are what both the kernel (``/proc/cpuinfo``) and the CPUID instruction as seen by
this process (numpy's own probe) report: an emulator or a VM whose CPUID hides a feature the host
kernel lists is taken at its word. ``KETCH_CPU_FLAGS`` ("avx2 fma", say) narrows the set further,
to run the path another machine would run; it can never add a flag the CPU lacks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_FLAGS = "KETCH_CPU_FLAGS"

# x86-64-v4: the AVX-512 subsets every AVX-512 CPU since Skylake-X (and Zen 4) has.
AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
# x86-64-v3's vector part: what paddle's CPU wheel itself is built for.
AVX2_FMA = frozenset({"avx", "avx2", "fma"})

# Every paddle op the engine calls that is built for one instruction set on the CPU, and every
# ISA-specific kernel of Ketch's own, with the flags it needs. Ops not listed were run on an
# AVX2-only CPU (Zen 3) and under an emulated one.
# A new fused/incubate op goes here before it is used, and is chosen through `CpuFeatures.has`.
ISA_SPECIFIC_OPS: Mapping[str, frozenset[str]] = {
    # phi::fusion::RmsNormAvxKernel: AVX-512 code, no dispatch (SIGILL on Zen 3).
    "paddle.incubate.nn.functional.fused_rms_norm": AVX512,
    # Ketch's own C++ kernels (csrc/paged_attention.cc), one per instruction set in a library
    # built for the x86-64 baseline: these names are the callables that run them.
    "ketch.kernels.paged_attention.paged_attention_avx512": AVX512,
    "ketch.kernels.paged_attention.paged_attention_avx2": AVX2_FMA,
    # csrc/packed_gemm.cc: the packed-weight GEMM's AVX-512 and AVX2 + FMA micro-kernels.
    "ketch.kernels.packed_linear.packed_linear_avx512": AVX512,
    "ketch.kernels.packed_linear.packed_linear_avx2": AVX2_FMA,
    # csrc/fused_moe.cc: the fused routed experts, on the same micro-kernels.
    "ketch.kernels.fused_moe.fused_moe_avx512": AVX512,
    "ketch.kernels.fused_moe.fused_moe_avx2": AVX2_FMA,
}

# Fused ops the engine calls that run on every x86-64 CPU paddle supports: seen on an AVX2-only
# Zen 3 and under the emulated one (tests/kernels/test_emulated_avx2_cpu.py).
PORTABLE_FUSED_OPS = frozenset({"paddle.nn.functional.swiglu"})

# numpy's CPUID feature names that differ from the kernel's /proc/cpuinfo flag names.
_NUMPY_NAMES = {"FMA3": "fma", "SSE41": "sse4_1", "SSE42": "sse4_2", "BMI": "bmi1"}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU flags this process may rely on, and where they came from."""

    flags: frozenset[str]
    source: str

    def has(self, required: Iterable[str]) -> bool:
        return frozenset(required) <= self.flags

    def can_run(self, op: str) -> bool:
        """Whether ``op`` (a key of ``ISA_SPECIFIC_OPS``) can run here."""
        return self.has(ISA_SPECIFIC_OPS[op])

    @classmethod
    def detect(
        cls,
        environ: Mapping[str, str] | None = None,
        cpuinfo: Path = Path("/proc/cpuinfo"),
    ) -> CpuFeatures:
        """This machine's features: /proc/cpuinfo ∩ CPUID (∩ ``KETCH_CPU_FLAGS`` when set)."""
        environ = os.environ if environ is None else environ
        kernel = _cpuinfo_flags(cpuinfo)
        cpuid = cpuid_flags()
        if kernel is not None and cpuid is not None:
            # A flag CPUID denies is dropped; flags numpy does not know come from the kernel.
            flags, source = kernel - cpuid.denied, "/proc/cpuinfo and CPUID"
        elif kernel is not None:
            flags, source = kernel, "/proc/cpuinfo"
        elif cpuid is not None:
            flags, source = cpuid.present, "CPUID"
        else:
            flags, source = frozenset(), "nothing (no /proc/cpuinfo, no CPUID probe)"
        override = environ.get(ENV_FLAGS)
        if override is not None:
            flags &= frozenset(override.lower().split())
            source += f", narrowed by {ENV_FLAGS}={override!r}"
        return cls(flags, source)


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The flags every processor in a /proc/cpuinfo text has (x86 "flags", Arm "Features")."""
    per_cpu = [
        frozenset(line.split(":", 1)[1].split())
        for line in text.splitlines()
        if line.split(":", 1)[0].strip() in ("flags", "Features") and ":" in line
    ]
    return frozenset.intersection(*per_cpu) if per_cpu else frozenset()


def _cpuinfo_flags(path: Path) -> frozenset[str] | None:
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        return None


@dataclass(frozen=True)
class CpuidView:
    present: frozenset[str]
    denied: frozenset[str]


def cpuid_flags(features: Mapping[str, bool] | None = None) -> CpuidView | None:
    """Flags as the CPUID instruction reports them to this process (numpy's runtime probe,
    which also checks that the OS saves the registers), in /proc/cpuinfo's spelling."""
    if features is None:
        try:
            from numpy._core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            try:  # numpy < 2
                from numpy.core._multiarray_umath import __cpu_features__ as features
            except ImportError:
                return None
    names = {_NUMPY_NAMES.get(k, k.lower()): bool(v) for k, v in features.items()}
    return CpuidView(
        present=frozenset(k for k, v in names.items() if v),
        denied=frozenset(k for k, v in names.items() if not v),
    )
