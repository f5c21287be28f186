"""``spec.engine.speculativeConfig``: an object generated from ``SpeculativeConfig``, checked by
the schema, by CEL rules that agree with the engine's, and by the engine's own checks at
reconcile; rendered into the decode (and mixed) pods' role file as the mapping ``ketch serve``
parses back into the same ``SpeculativeConfig``. The API server's side is in test_crd.py."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import yaml
from test_builders import example, invalid_body
from test_wiring_engine import serve_configs

from ketch.engine.spec_decode.config import METHODS, SpeculativeConfig
from ketch.operator import runnable
from ketch.operator.cli import render_object
from ketch.operator.crd import engine_fields
from ketch.operator.crd.document import crd_document
from ketch.operator.crd.engine import DRAFT_MODEL_PATTERN
from ketch.operator.spec.admission import evaluate_rule
from ketch.operator.spec.defaults import apply_defaults
from ketch.operator.spec.parse import InvalidSpec, parse
from ketch.operator.wiring import check_wiring

NGRAM = {"method": "ngram", "numSpeculativeTokens": 4}


def _schema() -> dict:
    spec = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["engine"]["properties"]["speculativeConfig"]


def _engine_config(value: dict) -> SpeculativeConfig:
    """The SpeculativeConfig a (defaulted) spec object describes, built directly."""
    names = {engine_fields.camel(f.name): f.name for f in dataclasses.fields(SpeculativeConfig)}
    return SpeculativeConfig(**{names[k]: v for k, v in value.items()})


def _with(speculative: dict | None, name: str = "mixed", **spec: dict) -> dict:
    body = example(name)
    body["spec"]["engine"] = {**body["spec"].get("engine", {}), "speculativeConfig": speculative}
    for key, value in spec.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value}
    return body


def test_the_object_is_generated_from_the_dataclass():
    """One source of truth: a property per SpeculativeConfig field (camelCase), with that
    field's help, enum, bounds and default; the fields without a default are required."""
    schema = _schema()
    assert schema["type"] == "object"
    assert "x-kubernetes-preserve-unknown-fields" not in schema
    assert "--speculative-config" in schema["description"]
    fields = dataclasses.fields(SpeculativeConfig)
    assert list(schema["properties"]) == [engine_fields.camel(f.name) for f in fields]
    assert schema["required"] == ["method", "numSpeculativeTokens"]
    for f in fields:
        node = schema["properties"][engine_fields.camel(f.name)]
        assert node["description"].startswith(f.metadata["help"])
        for bound in ("minimum", "maximum"):
            assert node.get(bound) == f.metadata.get(bound)
        if f.default is dataclasses.MISSING or f.default is None:
            assert "default" not in node
        else:
            assert node["default"] == f.default
    assert schema["properties"]["method"]["enum"] == list(METHODS)
    assert schema["properties"]["numSpeculativeTokens"] == {
        **schema["properties"]["numSpeculativeTokens"],
        "type": "integer",
        "minimum": 1,
        "maximum": 16,
    }
    assert schema["properties"]["model"]["pattern"] == DRAFT_MODEL_PATTERN


def test_it_is_an_engine_field_whose_flag_names_it():
    assert runnable.spec_field("speculative_config", "decode") == "spec.engine.speculativeConfig"
    assert engine_fields.flag_source("--speculative-config") == "spec.engine.speculativeConfig"
    assert "--speculative-config" in engine_fields.owned_flags()


# (spec object, whether SpeculativeConfig takes it): the CEL rules must agree with the engine.
_VALUES = [
    *(
        {"method": m, "numSpeculativeTokens": 2, **extra}
        for m in METHODS
        for extra in ({}, {"model": "/draft"}, {"promptLookupMax": 3, "promptLookupMin": 3})
    ),
    *(
        {"method": "ngram", "numSpeculativeTokens": 2, "promptLookupMax": hi, "promptLookupMin": lo}
        for hi, lo in itertools.product((1, 2, 64), (1, 2, 64))
    ),
    {"method": "ngram", "numSpeculativeTokens": 2, "promptLookupMax": 1},
]


def _id(value: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in value.items())


@pytest.mark.parametrize("value", _VALUES, ids=_id)
def test_the_cel_rules_agree_with_the_engine(value):
    schema = _schema()
    defaulted = apply_defaults(schema, value)
    cel_ok = all(evaluate_rule(r["rule"], defaulted) for r in schema["x-kubernetes-validations"])
    try:
        _engine_config(defaulted)
        engine_ok = True
    except ValueError:
        engine_ok = False
    assert cel_ok == engine_ok


INVALID = [
    ("wrong method", {"method": "eagle", "numSpeculativeTokens": 2}, ".method"),
    ("k 0", {"method": "ngram", "numSpeculativeTokens": 0}, ".numSpeculativeTokens"),
    ("k 17", {"method": "ngram", "numSpeculativeTokens": 17}, ".numSpeculativeTokens"),
    ("k missing", {"method": "ngram"}, "'numSpeculativeTokens' is a required property"),
    ("k a string", {"method": "ngram", "numSpeculativeTokens": "4"}, ".numSpeculativeTokens"),
    ("unknown key", {**NGRAM, "lookahead": 3}, "'lookahead' was unexpected"),
    ("snake case key", {**NGRAM, "prompt_lookup_max": 3}, "'prompt_lookup_max' was unexpected"),
    ("model without draft", {**NGRAM, "model": "/draft"}, ".model"),
    ("draft without model", {"method": "draft", "numSpeculativeTokens": 2}, ".model"),
    (
        "draft from hf",
        {"method": "draft", "numSpeculativeTokens": 2, "model": "hf://a/b"},
        ".model",
    ),
    ("relative draft", {"method": "draft", "numSpeculativeTokens": 2, "model": "d"}, ".model"),
    ("min above max", {**NGRAM, "promptLookupMax": 2, "promptLookupMin": 3}, ".promptLookupMin"),
    ("max below default min", {**NGRAM, "promptLookupMax": 1}, ".promptLookupMin"),
    ("lookup 65", {**NGRAM, "promptLookupMax": 65}, ".promptLookupMax"),
    ("batch -1", {**NGRAM, "disableByBatchSize": -1}, ".disableByBatchSize"),
    ("not an object", "ngram", "spec.engine.speculativeConfig"),
]


@pytest.mark.parametrize(("case", "value", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_the_operator_refuses_a_bad_object_naming_the_field(case, value, field):
    with pytest.raises(InvalidSpec) as info:
        parse(invalid_body({"engine": {"speculativeConfig": value}}))
    [problem] = info.value.problems
    assert problem.startswith("spec.engine.speculativeConfig"), problem
    wanted = field if field.startswith(("spec.", "'")) else f"spec.engine.speculativeConfig{field}"
    assert wanted in problem, problem


@pytest.mark.parametrize(
    ("value", "field", "says"),
    [
        ({**NGRAM, "model": "/draft"}, "model", "for method 'draft' only"),
        ({"method": "draft", "numSpeculativeTokens": 2}, "model", "required for method 'draft'"),
        ({**NGRAM, "promptLookupMax": 2, "promptLookupMin": 3}, "promptLookupMin", "[1, 2]"),
    ],
)
def test_at_reconcile_the_engines_own_checks_name_the_field(value, field, says):
    """The operator reconciles objects the API server admitted without re-running CEL
    (``cel=False``): the engine's own SpeculativeConfig checks still refuse a cross-field
    mistake (an older CRD), in the engine's words, named by the spec field (Degraded)."""
    with pytest.raises(InvalidSpec) as info:
        parse(invalid_body({"engine": {"speculativeConfig": value}}), cel=False)
    [problem] = info.value.problems
    assert problem.startswith(f"spec.engine.speculativeConfig.{field}: speculative_config.")
    assert says in problem


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("tiny", False),
        ("hf://org/target", False),
        ("file:///opt/target", False),
        ("pvc://store/target", True),
    ],
)
def test_a_draft_under_models_needs_a_pvc_model(uri, ok):
    body = _with({"method": "draft", "numSpeculativeTokens": 3, "model": "/models/draft"})
    body["spec"]["model"] = {"uri": uri}
    if ok:
        parse(body)
        return
    with pytest.raises(InvalidSpec) as info:
        parse(body)
    [problem] = info.value.problems
    assert problem.startswith("spec.engine.speculativeConfig.model: /models/draft: ")
    assert "pvc://" in problem


@pytest.mark.parametrize(
    "value",
    [
        NGRAM,
        {
            "method": "ngram",
            "numSpeculativeTokens": 16,
            "promptLookupMax": 8,
            "promptLookupMin": 1,
            "disableByBatchSize": 0,
        },
        {"method": "draft", "numSpeculativeTokens": 3, "model": "tiny"},
        {"method": "draft", "numSpeculativeTokens": 3, "model": "/opt/draft-model"},
    ],
)
def test_rendered_role_file_parses_back_to_the_same_config(value):
    """The mixed pod's role file holds the object with the engine's snake_case keys; `ketch
    serve`'s own parser (check-wiring reads the pod as the process would) turns it into a
    SpeculativeConfig equal to the one the spec describes, and to_json() round-trips."""
    body = _with(copy.deepcopy(value))
    children = render_object(body)
    assert check_wiring(children) == []
    config_map = next(o for o in children if o["kind"] == "ConfigMap")
    file = yaml.safe_load(config_map["data"]["mixed.yaml"])
    defaulted = apply_defaults(_schema(), value)
    expected = _engine_config(defaulted)
    assert SpeculativeConfig.parse(file["speculative_config"]) == expected
    assert file["speculative_config"] == yaml.safe_load(expected.to_json())
    assert serve_configs(children)["mixed"].speculative_config == expected
    engine = next(
        c
        for o in children
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["name"] == "engine"
    )
    assert not any(a.startswith("--speculative-config") for a in engine["args"])


def test_unset_renders_nothing():
    children = render_object(example("mixed"))
    config_map = next(o for o in children if o["kind"] == "ConfigMap")
    assert "speculative_config" not in yaml.safe_load(config_map["data"]["mixed.yaml"])
    assert serve_configs(children)["mixed"].speculative_config is None


def test_decode_speculates_and_prefill_does_not():
    """Roles take the one spec.engine; speculation happens in decode steps, so only the decode
    pods' role file carries it (prefill pods load no draft model)."""
    draft = {"method": "draft", "numSpeculativeTokens": 4, "model": "/models/draft"}
    children = render_object(_with(draft, "disaggregated"))  # pvc:// model: /models is its claim
    assert check_wiring(children) == []
    configs = serve_configs(children)
    assert configs["decode"].speculative_config == SpeculativeConfig(
        method="draft", num_speculative_tokens=4, model="/models/draft"
    )
    assert configs["prefill"].speculative_config is None


def test_extra_args_cannot_set_it():
    with pytest.raises(InvalidSpec) as info:
        parse(invalid_body({"engine": {"extraArgs": ["--speculative-config", "{}"]}}))
    assert "spec.engine.speculativeConfig" in str(info.value)


def test_mtp_on_a_model_without_mtp_layers_is_refused_at_reconcile():
    """The engine's own start-up refusal (capabilities), where the operator knows the model
    (the built-in tiny has no multi-token-prediction layer): the spec is invalid, the field
    named, no pods that would crash-loop."""
    body = _with({"method": "mtp", "numSpeculativeTokens": 1})
    with pytest.raises(InvalidSpec) as refused:
        render_object(body)
    message = str(refused.value)
    assert "spec.engine.speculativeConfig" in message
    assert "needs a checkpoint with multi-token-prediction layers" in message
