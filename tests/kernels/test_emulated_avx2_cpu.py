"""The engine on an emulated AVX2-only CPU (AMD EPYC Milan, Zen 3), whatever CPU runs the tests.

qemu's user-mode emulator runs this venv's Python with the CPUID of a Zen 3 and no AVX-512
decoding at all, so an AVX-512 instruction anywhere on the path is an illegal instruction there.
``ketch generate`` must pick the portable kernels from that CPUID and give the native run's text.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

QEMU = shutil.which("qemu-x86_64")
CPU_MODEL = "EPYC-Milan"
KETCH = str(Path(sys.executable).parent / "ketch")
# Under qemu an illegal instruction makes paddle's signal handler spin rather than exit.
EMULATED_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="needs qemu-x86_64 (Debian: qemu-user; .ci/run installs it) on an x86-64 machine",
)


def _emulated(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [QEMU, "-cpu", CPU_MODEL, sys.executable, *args],
            capture_output=True, text=True, timeout=EMULATED_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung on the emulated {CPU_MODEL} (an illegal instruction?): {exc.stderr}")


def test_the_emulated_cpu_has_avx2_and_no_avx512() -> None:
    probe = "from numpy._core._multiarray_umath import __cpu_features__ as f;"
    probe += "print(f['AVX2'], f['FMA3'], f['AVX512F'])"
    out = _emulated("-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


@pytest.mark.parametrize(
    "sampling",
    [[], ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "7"]],
    ids=["greedy", "sampled"],
)
def test_ketch_generate_runs_and_matches_the_native_output(sampling: list[str]) -> None:
    args = ["generate", "--log-level", "INFO", "--max-tokens", "12", *sampling]
    args += ["Alice was beginning to get", "The Mouse"]
    native = subprocess.run([KETCH, *args], capture_output=True, text=True, timeout=120)
    assert native.returncode == 0, native.stderr
    emulated = _emulated(KETCH, *args)
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    assert "rms_norm: portable" in emulated.stderr
    assert emulated.stdout == native.stdout
