"""The package layout: ``ketch.*`` imports, no stdlib shadowing, and a complete package list.

The design's top-level directories ``engine/``, ``operator/`` and ``kernels/`` hold the packages
one level down (``engine/ketch/engine`` is ``ketch.engine``, and so on), and none of the
top-level directories is itself a package: a ``python -m ...`` started in the repository root
(a user's own tool, vLLM's server for a side-by-side benchmark) must import the standard
library's ``operator``, not ours. pyproject lists the packages explicitly, so a new subpackage
that is not listed would be missing from a wheel; these tests catch that.
"""

from __future__ import annotations

import fnmatch
import importlib
import operator
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL = ("engine", "operator", "kernels")


# What the engine reads from a model directory at run time (train.py and the corpus are not).
TINY_RUNTIME_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def pyproject() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


ROOTS: dict[str, str] = pyproject()["tool"]["setuptools"]["package-dir"]


@pytest.mark.parametrize("name", sorted(ROOTS))
def test_top_level_packages_import(name: str) -> None:
    module = importlib.import_module(name)
    assert Path(module.__file__ or "").resolve().parent == REPO / ROOTS[name]


def test_stdlib_operator_is_not_shadowed() -> None:
    assert operator.add(2, 3) == 5
    assert not Path(operator.__file__ or "").resolve().is_relative_to(REPO)
    enum = importlib.import_module("enum")  # imports ``operator`` itself
    assert enum.Enum


def test_no_top_level_directory_is_a_package() -> None:
    assert {f"ketch.{name}": f"{name}/ketch/{name}" for name in TOP_LEVEL} == ROOTS
    for name in TOP_LEVEL:
        assert not (REPO / name / "__init__.py").exists(), name
        assert not (REPO / name / "ketch" / "__init__.py").exists(), name  # ketch: a namespace


def test_stdlib_module_runs_from_the_repository_root() -> None:
    """``python -m json.tool`` (and ``import operator``) from the root, with the root first on
    sys.path as ``-m`` puts it, use the standard library."""
    done = subprocess.run(
        [sys.executable, "-m", "json.tool"],
        input='{"a": [1, 2]}', capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"a"' in done.stdout
    # site may have imported the stdlib's operator already: forget it, so the path decides.
    probe = (
        "import sys; sys.modules.pop('operator', None); import operator, kernels, engine; "
        "print(operator.add(2, 3), engine.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    # engine/ and kernels/ are at most empty namespace directories, never our code.
    assert done.returncode == 0 and done.stdout.split()[0] == "5", done.stderr
    assert done.stdout.split()[1] == "None"


def test_tiny_model_dir_is_inside_the_package() -> None:
    import ketch.engine.models as models
    from ketch.engine.models.loader import TINY_MODEL_DIR

    package_dir = Path(models.__file__ or "").resolve().parent
    assert TINY_MODEL_DIR.resolve().parent == package_dir
    assert TINY_MODEL_DIR.name == "tiny"


def package_dirs() -> dict[str, Path]:
    """Every package the source tree holds: a directory with an ``__init__.py``."""
    found = {}
    for package, root in ROOTS.items():
        for init in sorted((REPO / root).rglob("__init__.py")):
            relative = init.parent.relative_to(REPO / root)
            if any(part.startswith((".", "__")) for part in relative.parts):
                continue
            found[".".join((package, *relative.parts))] = init.parent
    return found


def test_pyproject_lists_every_package() -> None:
    config = pyproject()["tool"]["setuptools"]
    assert config["package-dir"] == ROOTS
    listed = set(config["packages"])
    on_disk = set(package_dirs())
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject lists packages that do not exist"


def test_package_data_ships_the_tiny_model() -> None:
    from ketch.engine.models.loader import TINY_MODEL_DIR

    patterns = pyproject()["tool"]["setuptools"]["package-data"]["ketch.engine.models"]
    optional = ("chat_template.jinja", "model.safetensors.index.json", "model-*.safetensors")
    present = [
        f.name
        for f in TINY_MODEL_DIR.glob("*")
        if any(fnmatch.fnmatch(f.name, pattern) for pattern in optional)
    ]
    for name in (*TINY_RUNTIME_FILES, *present):
        assert any(fnmatch.fnmatch(f"tiny/{name}", p) for p in patterns), name


def test_console_script_points_at_the_cli() -> None:
    target = pyproject()["project"]["scripts"]["ketch"]
    module_name, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module_name), function))
