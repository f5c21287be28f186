"""The CRD: generated from the engine's config dataclasses, committed, valid, explainable."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ketch.engine.cli_args import flag_name
from ketch.engine.config import EngineConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator import crd, engine_fields
from ketch.operator.cli import main as operator_main

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / f"{crd.CRD_NAME}.yaml"


def _schema() -> dict:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_committed_crd_is_current(capsys):
    """crds/ is the output of `ketch-operator crd`; regenerate it with that command."""
    assert operator_main(["crd"]) == 0
    printed = capsys.readouterr().out
    assert CRD_FILE.read_text() == printed, (
        f"{CRD_FILE} is stale: run `ketch-operator crd > {CRD_FILE.relative_to(ROOT)}`"
    )


def test_every_engine_flag_is_a_crd_field_with_the_same_facts():
    """One source of truth: each EngineConfig/ServerConfig field the spec may set is a CRD field
    whose default, enum, bounds and description come from the same dataclass field."""
    spec = _schema()["properties"]["spec"]
    by_name = {f.name: f for f in engine_fields.config_fields()}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("crd") is False:
                assert f.name not in by_name
                continue
            node = spec
            for part in by_name[f.name].path:
                node = node["properties"][part]
            assert f.metadata["help"] in node["description"]
            assert flag_name(f.name) in node["description"]
            if f.default is not None:
                assert node["default"] == f.default
            else:
                assert "default" not in node
            if "choices" in f.metadata:
                assert node["enum"] == list(f.metadata["choices"])
            if "minimum" in f.metadata:
                assert node["minimum"] == f.metadata["minimum"]


def test_engine_settings_round_trip_to_the_engine_config():
    """A spec's engine fields become exactly the config-file keys `ketch serve` reads."""
    spec = {
        "engine": {"maxNumSeqs": 7, "blockSize": 32, "enablePrefixCaching": False},
        "ports": {"http": 9000, "metrics": 9100},
        "model": {"uri": "tiny", "name": "served"},
    }
    values = engine_fields.engine_settings(spec)
    assert values == {
        "max_num_seqs": 7,
        "block_size": 32,
        "enable_prefix_caching": False,
        "port": 9000,
        "metrics_port": 9100,
        "served_model_name": "served",
    }
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
    ServerConfig(**{k: v for k, v in values.items() if k not in engine_names})


def test_every_field_is_described():
    """`kubectl explain` is useful only if every field says what it is."""
    missing = [
        path
        for path, node in _walk(_schema()["properties"]["spec"])
        if path and not node.get("description")
    ]
    assert missing == []


def test_structure_names_and_printer_columns():
    obj = crd.crd()
    assert obj["metadata"]["name"] == "inferenceservices.serving.ketch.dev"
    names = obj["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "InferenceService",
        "inferenceservices",
        ["kisvc"],
    )
    version = obj["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Mode", "Replicas", "URL", "Age"]


def test_cel_rules_compile():
    import celpy

    env = celpy.Environment()
    rules = [
        rule["rule"]
        for _, node in _walk(_schema())
        for rule in node.get("x-kubernetes-validations", [])
    ]
    assert len(rules) >= 8
    for rule in rules:
        env.compile(rule)


@pytest.mark.skipif(
    shutil.which("kubernetes-validate") is None
    and not (Path(ROOT / ".venv/bin/kubernetes-validate").exists()),
    reason="kubernetes-validate is not installed",
)
@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_crd_passes_kubernetes_schema(version, tmp_path):
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd.crd()))
    exe = shutil.which("kubernetes-validate") or str(ROOT / ".venv/bin/kubernetes-validate")
    result = subprocess.run(
        [exe, "--strict", "-k", version, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
