"""CPU feature detection and the kernel choice it drives.

The choice must follow the CPU: an AVX2-only machine (Zen 3) gets the portable RMSNorm, an
AVX-512 one (Zen 4/5) the fused kernel, and neither source of flags alone can hand out an
instruction set the other denies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ketch.kernels import CpuKernels
from ketch.kernels.cpu_features import (
    AVX512,
    ENV_FLAGS,
    ISA_SPECIFIC_OPS,
    CpuFeatures,
    cpuid_flags,
    parse_cpuinfo,
)
from ketch.kernels.rms_norm import FUSED_OP, rms_norm_fused, rms_norm_portable

# The "flags" line of a 2-vCPU AMD EPYC 7763 (Zen 3, Milan) cloud VM: AVX2, no AVX-512.
ZEN3_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
    "tsc_reliable nonstop_tsc cpuid extd_apicid aperfmperf pni pclmulqdq ssse3 fma cx16 pcid "
    "sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy "
    "cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single vmmcall fsgsbase "
    "bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec "
    "xgetbv1 xsaves clzero xsaveerptr rdpru arat npt nrip_save umip vaes vpclmulqdq rdpid fsrm"
)
# The same for a Zen 5 (Turin) VM: AVX-512 as well.
ZEN5_FLAGS = ZEN3_FLAGS + (
    " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi "
    "avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq"
)


def _cpuinfo(flags: str, cpus: int = 2) -> str:
    block = "processor\t: {i}\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\nbugs\t\t: none\n"
    return "\n".join(block.format(i=i, flags=flags) for i in range(cpus))


def _features(tmp_path: Path, flags: str, environ: dict[str, str] | None = None) -> CpuFeatures:
    path = tmp_path / "cpuinfo"
    path.write_text(_cpuinfo(flags))
    return CpuFeatures.detect(environ or {}, cpuinfo=path)


def test_parse_reads_every_processor_and_keeps_only_common_flags() -> None:
    assert parse_cpuinfo(_cpuinfo(ZEN3_FLAGS)) == frozenset(ZEN3_FLAGS.split())
    mixed = _cpuinfo(ZEN5_FLAGS, 1) + "\n" + _cpuinfo(ZEN3_FLAGS, 1).replace(": 0", ": 1")
    assert parse_cpuinfo(mixed) == frozenset(ZEN3_FLAGS.split())  # what every CPU can run
    arm = parse_cpuinfo("Features\t: fp asimd evtstrm crc32\n")
    assert arm == {"fp", "asimd", "evtstrm", "crc32"}
    assert parse_cpuinfo("") == frozenset()


def test_zen3_gets_the_portable_rms_norm_and_zen5_the_fused_one(tmp_path: Path) -> None:
    zen3 = CpuFeatures(frozenset(ZEN3_FLAGS.split()), "test")
    zen5 = CpuFeatures(frozenset(ZEN5_FLAGS.split()), "test")
    assert not zen3.can_run(FUSED_OP) and zen5.can_run(FUSED_OP)
    assert CpuKernels.select(zen3).rms_norm is rms_norm_portable
    assert CpuKernels.select(zen5).rms_norm is rms_norm_fused
    assert CpuKernels.select(CpuFeatures(frozenset(), "none")).rms_norm is rms_norm_portable


def test_cpuid_denial_wins_over_the_kernel_flags(tmp_path: Path) -> None:
    """Under an emulator or a VM that hides AVX-512 in CPUID, cpuinfo may still list it."""
    says_no = cpuid_flags({"AVX512F": False, "AVX2": True, "FMA3": True})
    assert says_no is not None and "avx512f" in says_no.denied and "fma" in says_no.present
    path = tmp_path / "cpuinfo"
    path.write_text(_cpuinfo(ZEN5_FLAGS))
    detected = CpuFeatures.detect({}, cpuinfo=path)
    real = cpuid_flags()
    assert real is not None
    assert detected.flags.isdisjoint(real.denied)


def test_override_narrows_and_never_adds(tmp_path: Path) -> None:
    forced = _features(tmp_path, ZEN5_FLAGS, {ENV_FLAGS: "AVX2 fma"})
    assert forced.flags <= {"avx2", "fma"}
    assert not forced.can_run(FUSED_OP)
    assert ENV_FLAGS in forced.source
    zen3 = _features(tmp_path, ZEN3_FLAGS, {ENV_FLAGS: " ".join(AVX512)})
    assert not zen3.can_run(FUSED_OP)  # asking for AVX-512 does not make the CPU have it


def test_this_machine_is_read_as_its_cpuid_reports() -> None:
    """The flags the engine acts on agree with the CPU's own CPUID answer (numpy's probe) and
    with the kernel's /proc/cpuinfo, for every instruction set a kernel choice depends on."""
    features = CpuFeatures.detect({})
    cpuid = cpuid_flags()
    assert cpuid is not None
    kernel = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    for flag in sorted(set().union(*ISA_SPECIFIC_OPS.values()) | {"avx2", "fma", "avx"}):
        assert (flag in features.flags) == (flag in cpuid.present and flag in kernel), flag


def test_every_isa_specific_op_names_a_real_paddle_function() -> None:
    import importlib

    for op, flags in ISA_SPECIFIC_OPS.items():
        module, _, name = op.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), op
        assert flags, op


@pytest.mark.parametrize("forced", [True, False], ids=["forced-avx2", "as-detected"])
def test_the_choice_is_logged_once_at_start_up(forced: bool) -> None:
    env = {**os.environ, ENV_FLAGS: "avx avx2 fma"} if forced else dict(os.environ)
    if not forced:
        env.pop(ENV_FLAGS, None)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ketch"), "generate", "--log-level", "INFO",
         "--max-tokens", "4", "Alice was"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "rms_norm:" in line]
    assert len(lines) == 1, out.stderr
    fused = CpuFeatures.detect({}).can_run(FUSED_OP) and not forced
    assert ("fused AVX-512 kernel" if fused else "rms_norm: portable") in lines[0]


def _paddle_ops_used(root: Path) -> dict[str, list[str]]:
    """``{op: [file:line]}`` of every ``paddle.incubate`` name and every fused-looking name
    (``fused*``, ``swiglu``, ``flash_attention``) the code under ``root`` imports or uses."""
    import ast

    def fused(name: str) -> bool:
        return name.startswith("fused") or name in ("swiglu", "flash_attention")

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute) and (base := dotted(node.value)):
            return f"{base}.{node.attr}"
        return None

    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paddle"):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and (name := dotted(node)):
                names = [name]
            for name in names:
                if name.startswith("paddle.incubate.") or fused(name.rsplit(".", 1)[-1]):
                    found.setdefault(name, []).append(f"{path.name}:{node.lineno}")
    # ``paddle.incubate.nn.functional.fused_x`` also walks through its prefixes: keep the op.
    return {k: v for k, v in found.items() if not any(o.startswith(f"{k}.") for o in found)}


def test_every_fused_or_incubate_op_is_audited_and_isa_ones_stay_in_kernels() -> None:
    """A new fused op must be listed as ISA-specific (and chosen by the CPU's features) or as
    shown portable; an ISA-specific one may only be called from ``kernels/``."""
    from ketch.kernels.cpu_features import PORTABLE_FUSED_OPS

    repo = Path(__file__).resolve().parents[2]
    engine = _paddle_ops_used(repo / "engine")
    kernels = _paddle_ops_used(repo / "kernels")
    known = set(ISA_SPECIFIC_OPS) | PORTABLE_FUSED_OPS
    unaudited = {op: where for op, where in {**engine, **kernels}.items() if op not in known}
    assert not unaudited, f"add these to cpu_features' op lists: {unaudited}"
    outside = {op: where for op, where in engine.items() if op in ISA_SPECIFIC_OPS}
    assert not outside, (
        f"ISA-specific ops called outside kernels/ (choose via CpuKernels): {outside}"
    )
    paddle_ops = {op for op in ISA_SPECIFIC_OPS if op.startswith("paddle.")}
    assert paddle_ops <= set(kernels), "a listed ISA-specific op is no longer used"
    # The rest are Ketch's own C++ kernels: callables in ketch.kernels, chosen by CpuKernels.
    assert all(op.startswith("ketch.kernels.") for op in set(ISA_SPECIFIC_OPS) - paddle_ops)


def test_the_audit_sees_every_spelling(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "import paddle\nimport paddle.nn.functional as F\n"
        "from paddle.incubate.nn.functional import fused_bias_act\n"
        "y = paddle.incubate.nn.functional.fused_linear(x, w)\nz = F.swiglu(y)\n"
    )
    assert set(_paddle_ops_used(tmp_path)) == {
        "paddle.incubate.nn.functional.fused_bias_act",
        "paddle.incubate.nn.functional.fused_linear",
        "F.swiglu",
    }
