"""The package layout: ``ketch.*`` imports, no stdlib shadowing, and a complete package list.

The repository maps ``engine/``, ``operator/`` and ``kernels/`` onto ``ketch.engine``,
``ketch.operator`` and ``ketch.kernels``. pyproject lists the packages explicitly, so a new
subpackage that is not listed would be missing from a wheel; these tests catch that.
"""

from __future__ import annotations

import fnmatch
import importlib
import operator
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"ketch.engine": "engine", "ketch.operator": "operator", "ketch.kernels": "kernels"}
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


@pytest.mark.parametrize("name", sorted(ROOTS))
def test_top_level_packages_import(name: str) -> None:
    module = importlib.import_module(name)
    assert Path(module.__file__ or "").resolve().parent == REPO / ROOTS[name]


def test_stdlib_operator_is_not_shadowed() -> None:
    assert operator.add(2, 3) == 5
    assert not Path(operator.__file__ or "").resolve().is_relative_to(REPO)
    enum = importlib.import_module("enum")  # imports ``operator`` itself
    assert enum.Enum


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
