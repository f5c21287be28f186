"""Ketch's C++ paddle custom ops (``csrc/``): built at first use, once per source hash.

Why at run time and not at install: Ketch is one pure-Python distribution, installed editable in
development, and a build at install would need paddle inside pip's isolated build environment and
a platform wheel per CPU architecture. ``paddle.utils.cpp_extension.load`` instead compiles with
the machine's g++ against the headers in the installed paddle wheel (~10 s, once), into
``~/.cache/ketch/extensions/<name>-<hash>`` (``KETCH_EXTENSION_DIR`` to move it). The hash covers
the sources, the compiler flags and the paddle and Python versions, so a changed source gets a new
build and an unchanged one is only loaded (well under a second); a file lock keeps two processes
(tensor-parallel workers starting together) from building the same library at once. An image
builds them ahead (``KETCH_EXTENSION_DIR=/opt/ketch/extensions python -m ketch.kernels.cpp_ops``,
docker/engine.Dockerfile), so a pod (HOME on an emptyDir) never compiles at start-up; a read-only
directory of prebuilt libraries is loaded without the lock.

Two libraries: ``ops()`` (paged attention and the KV write) is compiled for the x86-64 baseline:
its AVX2 and AVX-512 kernels live in functions with their own ``target`` attribute and only run
when the caller picked them from CpuFeatures. ``gemm_ops()`` (``ketch_linear``) links OpenBLAS from
the ``scipy-openblas32`` wheel, which picks its own kernels from the CPU when it loads; without
that wheel only the GEMM is missing.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import paddle

SOURCE_DIR = Path(__file__).with_name("csrc")
# Baseline x86-64 code generation: no -march; the ISA-specific kernels carry their own targets.
CXX_FLAGS = (
    "-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fvisibility-inlines-hidden",
)  # fmt: skip
LD_FLAGS = ("-fopenmp",)
ENV_DIR = "KETCH_EXTENSION_DIR"


@dataclass(frozen=True)
class Library:
    """One op library: its sources and what it compiles and links with."""

    prefix: str
    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()
    include_paths: tuple[str, ...] = ()
    ld_flags: tuple[str, ...] = LD_FLAGS

    def key(self) -> str:
        """What the built library depends on: sources, flags, paddle and Python versions."""
        digest = hashlib.sha256()
        for name in (*self.sources, *self.headers):
            digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
        versions = (paddle.__version__, sys.version_info[:2])
        digest.update(repr((CXX_FLAGS, self.ld_flags, self.include_paths, versions)).encode())
        return digest.hexdigest()[:16]


ATTENTION = Library(
    "ketch_ops",
    ("paged_attention.cc", "fused.cc", "comm.cc", "packed_gemm.cc", "fused_moe.cc"),
    ("simd.h", "attention_kernel.inc", "packed_gemm.h", "bf16.h"),
)


def gemm_library() -> Library:
    """The GEMM library, linked against the scipy-openblas32 wheel (ImportError without it)."""
    import scipy_openblas32 as openblas

    lib = openblas.get_lib_dir()
    return Library(
        "ketch_gemm",
        ("gemm.cc",),
        include_paths=(openblas.get_include_dir(),),
        ld_flags=(f"-L{lib}", f"-l{openblas.get_library()}", f"-Wl,-rpath,{lib}"),
    )


def build_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "ketch" / "extensions")


def ops() -> ModuleType:
    """The loaded op module (``ketch_paged_attention``, ``ketch_reshape_and_cache``, the fused
    norm and rotary ops of ``fused``, the packed GEMM, the fused experts). A failed
    build raises the same error on every later call without building again."""
    return _loaded("attention")


def gemm_ops() -> ModuleType:
    """The loaded GEMM module (``ketch_linear``); RuntimeError as ``ops()``."""
    return _loaded("gemm")


def _loaded(which: str) -> ModuleType:
    loaded = _load(which)
    if isinstance(loaded, Exception):
        raise RuntimeError(f"Ketch's C++ {which} ops could not be built: {loaded}") from loaded
    return loaded


@functools.cache
def _load(which: str) -> ModuleType | Exception:
    try:
        return _build_or_import(ATTENTION if which == "attention" else gemm_library())
    except Exception as exc:  # a compiler error, a missing toolchain or wheel: reported later
        return exc


def _build_or_import(library: Library) -> ModuleType:
    name = f"{library.prefix}_{library.key()}"
    root = build_dir()
    built = root / name / f"{name}.so"
    if built.exists() and not os.access(root, os.W_OK):
        # A read-only directory of prebuilt libraries (an image's KETCH_EXTENSION_DIR, on a
        # read-only root filesystem): nobody can be writing it, and no lock file can be made.
        return _import_built(name, built.parent)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = root / name / f"{name}.so"
        if built.exists():
            return _import_built(name, built.parent)
        from paddle.utils.cpp_extension import load

        return load(
            name=name,
            sources=[str(SOURCE_DIR / s) for s in library.sources],
            extra_cxx_cflags=list(CXX_FLAGS),
            extra_ldflags=list(library.ld_flags),
            extra_include_paths=[str(SOURCE_DIR), *library.include_paths],
            build_directory=str(root),
        )


def _import_built(name: str, directory: Path) -> ModuleType:
    # paddle's own loader for a built library (what `load` ends with), so a cached build is not
    # handed to setuptools again; pinned paddle, checked by the tests. The loader writes a Python
    # wrapper beside the library, so a read-only directory (an image's prebuilt kernels on a
    # read-only root filesystem) is loaded through a link in a private temporary directory.
    from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

    if not os.access(directory, os.W_OK):
        directory = _writable_view(name, directory)
    return _import_module_from_library(name, str(directory))


def _writable_view(name: str, directory: Path) -> Path:
    view = Path(tempfile.mkdtemp(prefix=f"ketch-{name[:24]}-"))
    atexit.register(shutil.rmtree, view, True)
    (view / f"{name}.so").symlink_to(directory / f"{name}.so")
    return view


if __name__ == "__main__":
    print(ops().__file__)
    print(gemm_ops().__file__)
