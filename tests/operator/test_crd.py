"""The CRD: generated from the engine's config dataclasses, committed, valid, explainable."""

from __future__ import annotations

import copy
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
from kubeemu import crd_budget

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


def _committed() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


def test_committed_crd_fits_the_apiservers_cel_cost_budgets():
    """kube-apiserver prices every rule at CRD creation and refuses one estimated above 1e7
    (cost of one evaluation x evaluations per object) or rules adding up to more than 1e8."""
    definition = _committed()
    schema = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    costs = crd_budget.schema_rule_costs(schema)
    table = "\n".join(f"{c.cost:>12} {c.path}" for c in costs)
    assert len(costs) >= 8
    assert all(c.cost <= crd_budget.STATIC_ESTIMATED_COST_LIMIT for c in costs), table
    assert sum(c.cost for c in costs) <= crd_budget.STATIC_ESTIMATED_CRD_COST_LIMIT, table
    assert crd_budget.crd_cost_causes(definition) == []


def _unbounded(node: dict) -> bool:
    if node.get("type") == "string" or node.get("x-kubernetes-int-or-string"):
        return "maxLength" not in node and "enum" not in node
    if node.get("type") == "array":
        return "maxItems" not in node
    return isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node


def test_every_string_list_and_map_of_the_spec_is_bounded():
    """The root's rules may read any field, so nothing a rule could reach is sized from the
    3 MiB request limit (free-form Kubernetes types are invisible to CEL)."""
    spec = _schema()["properties"]["spec"]
    assert [path for path, node in _walk(spec) if _unbounded(node)] == []
    meta = _schema()["properties"]["metadata"]["properties"]
    assert meta["name"]["maxLength"] == meta["generateName"]["maxLength"] == 253


def test_the_old_regex_rule_over_unbounded_strings_is_refused():
    """The extraArgs rule as it was: a regex of every owned flag over strings without a
    maxLength. Each match is priced at ceil((1 + 3 MiB) * 0.1) * ceil(len(regex) * 0.25)."""
    definition = copy.deepcopy(crd.crd())
    schema = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    extra = schema["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"]
    del extra["items"]["maxLength"]
    regex = "^(" + "|".join(engine_fields.owned_flags()) + ")(=.*)?$"
    extra["x-kubernetes-validations"][0]["rule"] = f"self.all(a, !a.matches('{regex}'))"
    rule = (
        "spec.validation.openAPIV3Schema.properties[spec].properties[engine]"
        ".properties[extraArgs].x-kubernetes-validations[0].rule"
    )
    hint = (
        "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where "
        "arrays, maps, and strings are declared)"
    )
    total = sum(c.cost for c in crd_budget.schema_rule_costs(schema))
    assert total > 100 * crd_budget.STATIC_ESTIMATED_COST_LIMIT  # 64 strings of 3 MiB each
    causes = crd_budget.crd_cost_causes(definition)
    assert [(c["field"], c["message"]) for c in causes] == [
        (rule, f"Forbidden: estimated rule cost exceeds budget by factor of more than 100x {hint}"),
        (
            rule,
            "Forbidden: contributed to estimated rule cost total exceeding cost limit for "
            "entire OpenAPIv3 schema",
        ),
        (
            "spec.validation.openAPIV3Schema",
            "Forbidden: x-kubernetes-validations estimated rule cost total for entire "
            f"OpenAPIv3 schema exceeds budget by factor of {total / 1e8:.1f}x {hint}",
        ),
    ]


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
