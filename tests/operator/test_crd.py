"""The CRD: generated from the engine's config dataclasses, committed, valid, explainable.

The API server is the session's real kube-apiserver (tests/kubecluster.py): it prices the CEL
rules when the CRD is created (its own cost estimator decides), runs them on every object, and
serves `kubectl explain` and the printer columns."""

from __future__ import annotations

import copy
import dataclasses
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from test_builders import invalid_body

import procs
from ketch.engine.cli_args import flag_name
from ketch.engine.config import EngineConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator import api_names
from ketch.operator.cli import main as operator_main
from ketch.operator.crd import engine_fields
from ketch.operator.crd.document import crd_document
from kubecluster import kubectl, wait_established

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / f"{api_names.CRD_NAME}.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _schema() -> dict:
    return crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


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
    obj = crd_document()
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


def _kubectl(kube, *args: str, input: str | None = None) -> str:
    """kubectl's output; AssertionError with its stderr when it fails."""
    result = kubectl(kube, *args, input=input)
    assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def _wait_established(kube, name: str) -> None:
    wait_established(kube, f"crd/{name}")


def _renamed(definition: dict, tag: str) -> dict:
    """``definition`` in another API group and under other names (no short name, no category):
    it installs beside the committed CRD without touching it, and `kisvc`, `inferenceservices`
    and `kubectl get all` keep naming the committed one only."""
    out = copy.deepcopy(definition)
    group = f"{tag}-{uuid.uuid4().hex[:6]}.ketch.test"
    plural = f"{tag}inferenceservices"
    out["spec"]["group"] = group
    out["spec"]["names"] = {
        "kind": f"{tag.capitalize()}InferenceService",
        "listKind": f"{tag.capitalize()}InferenceServiceList",
        "plural": plural,
        "singular": f"{tag}inferenceservice",
    }
    out["metadata"]["name"] = f"{plural}.{group}"
    return out


def _rules(schema: dict) -> list[str]:
    return [
        r["rule"] for _, node in _walk(schema) for r in node.get("x-kubernetes-validations", [])
    ]


def test_committed_crd_fits_the_apiservers_cel_cost_budgets(kube):
    """kube-apiserver prices every CEL rule when a CRD is created: one estimated above its
    per-rule budget (cost of one evaluation x evaluations per object), or rules adding up to more
    than the schema's, and the create is refused. Its own estimator decides: the committed CRD,
    created under a group and names of its own, is accepted, established and served."""
    definition = _renamed(_committed(), "budget")
    name, group = definition["metadata"]["name"], definition["spec"]["group"]
    plural = definition["spec"]["names"]["plural"]
    assert len(_rules(definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"])) >= 8
    created = kube.post(CRDS, definition)
    try:
        created.ok()
        _wait_established(kube, name)
        # served once its storage has started (until then a list is 429 "storage is
        # (re)initializing")
        listed = procs.wait_for(
            lambda: (r := kube.get(f"/apis/{group}/v1alpha1/{plural}")).status != 429 and r,
            30,
            "the new CRD's storage",
            interval=0.2,
        )
        assert listed.ok()["items"] == []
    finally:
        kube.delete(f"{CRDS}/{name}")


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


def _with_the_old_extra_args_rule(tag: str, *, max_length: bool) -> dict:
    """The CRD with extraArgs' rule as it was, a regex of every owned flag; its strings keep
    their maxLength or lose it."""
    definition = _renamed(crd_document(), tag)
    schema = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    extra = schema["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"]
    if not max_length:
        del extra["items"]["maxLength"]
    regex = "^(" + "|".join(engine_fields.owned_flags()) + ")(=.*)?$"
    extra["x-kubernetes-validations"][0]["rule"] = f"self.all(a, !a.matches('{regex}'))"
    return definition


def test_the_old_regex_rule_over_unbounded_strings_is_refused(kube):
    """The extraArgs rule as it was: a regex of every owned flag over strings without a
    maxLength. The API server sizes such a string from the 3 MiB request limit and prices each
    match by that length and the regex's: over the per-rule budget more than 100 times, and the
    schema's total with it. The same rule over strings of at most 1024 characters fits."""
    definition = _with_the_old_extra_args_rule("regex", max_length=False)
    name = definition["metadata"]["name"]
    refused = kube.post(CRDS, definition)
    if refused.status < 400:
        kube.delete(f"{CRDS}/{name}")
    assert refused.status == 422, refused.body
    assert refused.body["reason"] == "Invalid"
    rule = (
        "spec.validation.openAPIV3Schema.properties[spec].properties[engine]"
        ".properties[extraArgs].x-kubernetes-validations[0].rule"
    )
    hint = (
        "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where "
        "arrays, maps, and strings are declared)"
    )
    causes = [(c["reason"], c["field"], c["message"]) for c in refused.body["details"]["causes"]]
    assert causes[:2] == [
        (
            "FieldValueForbidden",
            rule,
            f"Forbidden: estimated rule cost exceeds budget by factor of more than 100x {hint}",
        ),
        (
            "FieldValueForbidden",
            rule,
            "Forbidden: contributed to estimated rule cost total exceeding cost limit for "
            "entire OpenAPIv3 schema",
        ),
    ]
    assert len(causes) == 3, causes
    reason, field, message = causes[2]
    assert (reason, field) == ("FieldValueForbidden", "spec.validation.openAPIV3Schema")
    total = re.fullmatch(
        r"Forbidden: x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 "
        rf"schema exceeds budget by factor of (\d+\.\d)x {re.escape(hint)}",
        message,
    )
    assert total, message
    assert float(total[1]) > 10  # 64 strings of 3 MiB each: over 100 x the per-rule limit
    assert kube.get(f"{CRDS}/{name}").status == 404
    bounded = _with_the_old_extra_args_rule("bounded", max_length=True)
    kube.post(f"{CRDS}?dryRun=All", bounded).ok()


# --------------------------------------------------------------------------- on the API server


@pytest.fixture(scope="module")
def installed(kube):
    """The committed CRD, applied server-side (as tests/operator/test_e2e.py does) and
    Established."""
    _kubectl(kube, "apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    _wait_established(kube, api_names.CRD_NAME)
    collection = f"/apis/{api_names.API_VERSION}/{api_names.PLURAL}"
    procs.wait_for(  # a new CRD's storage answers 429 "storage is (re)initializing" at first
        lambda: kube.get(collection).status != 429, 30, "the CRD's storage", interval=0.2
    )
    # Its OpenAPI v3 is published a moment after: until then `kubectl explain` says
    # couldn't find resource for "serving.ketch.dev/v1alpha1, Resource=inferenceservices".
    deadline = time.monotonic() + 30
    while (explained := kubectl(kube, "explain", "kisvc.spec")).returncode != 0:
        assert time.monotonic() < deadline, f"kubectl explain kisvc.spec: {explained.stderr}"
        time.sleep(0.2)
    return kube


def test_the_committed_crd_installs_and_is_established(installed):
    body = installed.get(f"{CRDS}/{api_names.CRD_NAME}").ok()
    conditions = {c["type"]: c["status"] for c in body["status"]["conditions"]}
    assert conditions["Established"] == conditions["NamesAccepted"] == "True"
    assert body["status"]["acceptedNames"]["shortNames"] == ["kisvc"]
    assert body["spec"]["versions"][0]["schema"] == _committed()["spec"]["versions"][0]["schema"]


def _explain(kube, field: str) -> str:
    return " ".join(_kubectl(kube, "explain", field).split())  # explain wraps descriptions


@pytest.mark.parametrize(
    ("field", "kind", "says"),
    [
        ("inferenceservice.spec.engine.maxNumSeqs", "integer", "(ketch serve --max-num-seqs)"),
        ("kisvc.spec.roles.mixed.resources.gpus", "integer", "GPUs (gpuResourceName) per pod."),
        ("inferenceservices.spec.model.uri", "string", None),
        ("kisvc.spec.engine.speculativeConfig", "Object", "(ketch serve --speculative-config)"),
        ("kisvc.spec.engine.speculativeConfig.numSpeculativeTokens", "integer", "(k)"),
        ("kisvc.status.replicas", "string", "Ready/desired engine pods over all roles"),
    ],
)
def test_kubectl_explain_gives_each_fields_description(installed, field, kind, says):
    text = _explain(installed, field)
    node = _schema()
    for part in field.split(".")[1:]:
        node = node["properties"][part]
    assert f"KIND: {api_names.KIND} VERSION: v1alpha1" in text
    assert f"FIELD: {field.split('.')[-1]} <{kind}>" in text
    assert " ".join(node["description"].split()) in text
    if says:
        assert says in text


def test_kubectl_explain_lists_the_top_level_fields(installed):
    text = _explain(installed, "kisvc")
    assert " ".join(_schema()["description"].split()) in text
    assert "spec <Object> -required-" in text and "status <Object>" in text


def test_kubectl_get_shows_the_printer_columns(installed, namespace):
    """The columns of additionalPrinterColumns, read from the status the operator writes."""
    body = yaml.safe_load((ROOT / "examples" / "mixed.yaml").read_text())
    body["metadata"]["name"] = "cols"
    _kubectl(installed, "-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(body))
    status = {
        "observedGeneration": 1,
        "mode": "mixed",
        "replicas": "1/2",
        "url": f"http://cols.{namespace}.svc:8000",
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "Progressing",
                "message": "1 of 2",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            },
        ],
    }
    path = f"/apis/{api_names.API_VERSION}/namespaces/{namespace}/{api_names.PLURAL}/cols/status"
    installed.patch(path, {"status": status}).ok()
    header, row, *rest = _kubectl(installed, "-n", namespace, "get", "kisvc").splitlines()
    assert rest == []
    assert header.split() == ["NAME", "READY", "MODE", "REPLICAS", "URL", "AGE"]
    assert row.split()[:5] == ["cols", "False", "mixed", "1/2", status["url"]]
    columns = [
        c["name"].upper() for c in crd_document()["spec"]["versions"][0]["additionalPrinterColumns"]
    ]
    assert header.split() == ["NAME", *columns]
    # its categories: `kubectl get ketch` and `kubectl get all` list it
    for category in ("ketch", "all"):
        listed = _kubectl(installed, "-n", namespace, "get", category, "-o", "name")
        assert "inferenceservice.serving.ketch.dev/cols" in listed.split()


def _rule_message(start: str) -> str:
    """The message of the CRD's CEL rule(s) whose message begins with ``start``."""
    [message] = {
        r["message"]
        for _, node in _walk(_schema())
        for r in node.get("x-kubernetes-validations", [])
        if r["message"].startswith(start)
    }
    return message


NGRAM = {"method": "ngram", "numSpeculativeTokens": 4}

REFUSED_BY_RULES = [
    (
        "min above max",
        {"roles": {"mixed": {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}}}},
        [("spec.roles.mixed.autoscaling.minReplicas", "minReplicas must not exceed")],
    ),
    (
        "keda without prometheus",
        {"roles": {"mixed": {"autoscaling": {"mode": "keda", "maxReplicas": 2}}}},
        [("spec.roles.mixed.autoscaling.prometheusAddress", "mode 'keda' needs")],
    ),
    ("ports clash", {"ports": {"http": 8002}}, [("spec.ports", "ports must be distinct")]),
    (
        "mixed and prefill",
        {"roles": {"mixed": {}, "prefill": {}, "decode": {}}},
        [
            ("spec.roles", "set either roles.mixed"),
            ("spec.auth", "roles.prefill/decode (disaggregated serving) need auth"),
        ],
    ),
    (
        "extra args own flag",
        {"engine": {"extraArgs": ["--port=1"]}},
        [("spec.engine.extraArgs", "extraArgs may not set")],
    ),
    (
        "tp above gpus",
        {"engine": {"tensorParallelSize": 4}, "roles": {"mixed": {"resources": {"gpus": 2}}}},
        [("spec.engine.tensorParallelSize", "engine.tensorParallelSize must equal roles.mixed")],
    ),
    (
        "speculative model without draft",
        {"engine": {"speculativeConfig": {**NGRAM, "model": "/opt/draft"}}},
        [("spec.engine.speculativeConfig.model", "model is for method 'draft' only")],
    ),
    (
        "speculative draft without model",
        {"engine": {"speculativeConfig": {"method": "draft", "numSpeculativeTokens": 2}}},
        [("spec.engine.speculativeConfig.model", "model is required for method 'draft'")],
    ),
    (
        "speculative lookup min above max",
        {"engine": {"speculativeConfig": {**NGRAM, "promptLookupMax": 2, "promptLookupMin": 3}}},
        [("spec.engine.speculativeConfig.promptLookupMin", "promptLookupMin must not exceed")],
    ),
    (
        "speculative lookup max below the default min",
        {"engine": {"speculativeConfig": {**NGRAM, "promptLookupMax": 1}}},
        [("spec.engine.speculativeConfig.promptLookupMin", "promptLookupMin must not exceed")],
    ),
]


@pytest.mark.parametrize(
    ("case", "patch", "expected"), REFUSED_BY_RULES, ids=[c[0] for c in REFUSED_BY_RULES]
)
def test_a_spec_breaking_a_rule_is_refused_with_its_message(installed, case, patch, expected):
    """The API server runs the CRD's CEL rules: the refusal names the field (the rule's
    fieldPath) and says the rule's message, to the API client and to kubectl's user."""
    body = invalid_body(patch)
    body["metadata"]["name"] = "bad"
    path = f"/apis/{api_names.API_VERSION}/namespaces/default/{api_names.PLURAL}"
    refused = installed.post(f"{path}?dryRun=All", body)
    assert refused.status == 422, refused.body
    wanted = [(field, f"Invalid value: {_rule_message(start)}") for field, start in expected]
    causes = [(c["field"], c["message"]) for c in refused.body["details"]["causes"]]
    assert sorted(causes) == sorted(wanted)
    assert {c["reason"] for c in refused.body["details"]["causes"]} == {"FieldValueInvalid"}
    shown = _server_dry_run(installed, body)
    assert shown.returncode != 0
    assert 'The InferenceService "bad" is invalid: ' in shown.stderr
    for field, message in wanted:
        assert f"{field}: {message}" in shown.stderr
    body["spec"] = invalid_body({})["spec"]  # the example as it is passes
    installed.post(f"{path}?dryRun=All", body).ok()


SPECULATIVE_REFUSED_BY_SCHEMA = [
    ("wrong method", {"method": "eagle", "numSpeculativeTokens": 2}, "method", "NotSupported"),
    ("k 0", {"method": "ngram", "numSpeculativeTokens": 0}, "numSpeculativeTokens", "Invalid"),
    ("k 17", {"method": "ngram", "numSpeculativeTokens": 17}, "numSpeculativeTokens", "Invalid"),
    ("k missing", {"method": "ngram"}, "numSpeculativeTokens", "Required"),
    (
        "relative draft",
        {"method": "draft", "numSpeculativeTokens": 1, "model": "d"},
        "model",
        "Invalid",
    ),
    ("batch -1", {**NGRAM, "disableByBatchSize": -1}, "disableByBatchSize", "Invalid"),
]


@pytest.mark.parametrize(
    ("case", "value", "field", "reason"),
    SPECULATIVE_REFUSED_BY_SCHEMA,
    ids=[c[0] for c in SPECULATIVE_REFUSED_BY_SCHEMA],
)
def test_the_api_server_refuses_a_bad_speculative_config_naming_the_field(
    installed, case, value, field, reason
):
    """engine.speculativeConfig is an object whose enum, bounds and required keys (generated
    from SpeculativeConfig) the API server enforces, each refusal naming the key."""
    body = invalid_body({"engine": {"speculativeConfig": value}})
    body["metadata"]["name"] = "bad-spec"
    path = f"/apis/{api_names.API_VERSION}/namespaces/default/{api_names.PLURAL}"
    refused = installed.post(f"{path}?dryRun=All", body)
    assert refused.status == 422, refused.body
    causes = [(c["field"], c["reason"]) for c in refused.body["details"]["causes"]]
    # A wrong enum value or a missing key also stops the CEL rules, which the server says
    # in a cause of its own with no field.
    skipped = [c for c in refused.body["details"]["causes"] if c["field"] == "<nil>"]
    assert all("validation rules were not checked" in c["message"] for c in skipped)
    causes = [c for c in causes if c[0] != "<nil>"]
    assert causes == [(f"spec.engine.speculativeConfig.{field}", f"FieldValue{reason}")]


def test_the_api_server_takes_a_speculative_config_and_refuses_unknown_keys(installed):
    """A valid object is stored with its defaults filled in; an unknown key (a typo, or the
    engine's snake_case spelling) is refused by a strict client, as kubectl is by default, and
    dropped (with a warning) for one that asks for no field validation."""
    path = f"/apis/{api_names.API_VERSION}/namespaces/default/{api_names.PLURAL}"
    body = invalid_body({"engine": {"speculativeConfig": dict(NGRAM)}})
    body["metadata"]["name"] = "spec-ok"
    stored = installed.post(f"{path}?dryRun=All&fieldValidation=Strict", body).ok()
    assert stored["spec"]["engine"]["speculativeConfig"] == {
        **NGRAM,
        "promptLookupMax": 4,
        "promptLookupMin": 2,
        "disableByBatchSize": 8,
    }
    body["spec"]["engine"]["speculativeConfig"]["prompt_lookup_max"] = 3
    refused = installed.post(f"{path}?dryRun=All&fieldValidation=Strict", body)
    assert refused.status in (400, 422), refused.body
    assert 'unknown field "spec.engine.speculativeConfig.prompt_lookup_max"' in str(refused.body)
    shown = _server_dry_run(installed, body)
    assert shown.returncode != 0
    assert "spec.engine.speculativeConfig.prompt_lookup_max" in shown.stderr
    pruned = installed.post(f"{path}?dryRun=All", body).ok()  # the default: Warn
    assert "prompt_lookup_max" not in pruned["spec"]["engine"]["speculativeConfig"]


@pytest.mark.skipif(
    shutil.which("kubernetes-validate") is None
    and not (Path(ROOT / ".venv/bin/kubernetes-validate").exists()),
    reason="kubernetes-validate is not installed",
)
@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_crd_passes_kubernetes_schema(version, tmp_path):
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd_document()))
    exe = shutil.which("kubernetes-validate") or str(ROOT / ".venv/bin/kubernetes-validate")
    result = subprocess.run(
        [exe, "--strict", "-k", version, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _server_dry_run(installed, body: dict) -> subprocess.CompletedProcess:
    """``kubectl apply --dry-run=server`` of ``body`` in namespace default."""
    return kubectl(
        installed, "-n", "default", "apply", "--dry-run=server", "-f", "-",
        input=yaml.safe_dump(body),
    )  # fmt: skip
