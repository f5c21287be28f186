"""The install steps of docs/operator.md, run as written against an API server."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeemu import start_emulator

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operator.md"


def doc_commands(after: str) -> list[str]:
    """The first ```bash block after the line containing ``after``, joined continuation lines."""
    text = DOC.read_text()
    start = text.index(after)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block after {after!r} in {DOC}"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture
def fresh_cluster(tmp_path) -> Iterator[dict[str, str]]:
    """A new emulator per test: the install creates cluster-scoped objects."""
    if os.environ.get("KETCH_TEST_KUBECONFIG"):
        pytest.skip("installs cluster-wide objects; runs against the emulator only")
    emu = start_emulator()
    try:
        yield {**os.environ, "KUBECONFIG": str(emu.kubeconfig)}
    finally:
        emu.stop()


def run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert command.startswith("kubectl "), command
    return subprocess.run(
        command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "section", ["Apply the CRDs first", "To serve one namespace instead"], ids=["cluster", "ns"]
)
def test_documented_install_works(fresh_cluster, section):
    for command in doc_commands(section):
        result = run(command, fresh_cluster)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    pods = run("kubectl -n ketch-system get deployment ketch-operator -o name", fresh_cluster)
    assert pods.stdout.strip() == "deployment.apps/ketch-operator"
