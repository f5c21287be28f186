"""Tests for kubeemu.validation: CRD pruning, defaulting, OpenAPI and CEL validation.

The CRD here is a small stand-alone "Widget" (not Ketch's InferenceService) that exercises
every schema feature the emulator supports; expected messages are kube-apiserver v1.32's.
"""

from __future__ import annotations

import copy
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubeemu.validation import AdmitResult, CRDSchemaError, CRDValidator, format_causes

BLOCKED = (
    '<nil>: Invalid value: "null": some validation rules were not checked because the object '
    "was invalid; correct the existing errors to complete validation"
)

TOLERATION = {
    "type": "object",
    "x-kubernetes-validations": [
        {
            "rule": "self.operator != 'Exists' || !has(self.value)",
            "message": "value must be empty when operator is Exists",
            "fieldPath": ".value",
        }
    ],
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Equal", "Exists"], "default": "Equal"},
        "value": {"type": "string"},
    },
}

ROLE = {
    "type": "object",
    "x-kubernetes-validations": [
        {
            "rule": "self.replicas <= 8",
            "messageExpression": "'replicas is ' + string(self.replicas) + ', at most 8'",
        }
    ],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0, "default": 1},
        "tolerations": {"type": "array", "maxItems": 3, "items": TOLERATION},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

SPEC = {
    "type": "object",
    "required": ["model"],
    "x-kubernetes-validations": [
        {
            "rule": "has(self.image) != has(self.imageRef)",
            "message": "exactly one of image or imageRef must be set",
        },
        {
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "minReplicas must not exceed maxReplicas",
            "fieldPath": ".minReplicas",
        },
        {"rule": "!has(self.max__dash__tokens) || self.max__dash__tokens % 2 == 0"},
    ],
    "properties": {
        "image": {"type": "string", "minLength": 3, "maxLength": 20},
        "imageRef": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}},
        },
        "model": {
            "type": "object",
            "required": ["uri"],
            "properties": {
                "uri": {"type": "string", "pattern": "^(hf|s3)://[a-z0-9./_-]+$"},
                "revision": {"type": "string", "default": "main"},
            },
        },
        "minReplicas": {"type": "integer", "minimum": 0, "default": 1},
        "maxReplicas": {"type": "integer", "minimum": 1, "maximum": 100, "default": 3},
        "max-tokens": {"type": "integer"},
        "engine": {
            "type": "object",
            "default": {},
            "properties": {
                "blockSize": {"type": "integer", "enum": [16, 32, 64, 128], "default": 16},
                "maxNumSeqs": {"type": "integer", "format": "int32", "default": 256},
                "gpuMemoryUtilization": {
                    "type": "number",
                    "minimum": 0,
                    "exclusiveMinimum": True,
                    "maximum": 1,
                    "default": 0.9,
                },
                "dtype": {
                    "type": "string",
                    "enum": ["auto", "float16", "bfloat16"],
                    "default": "auto",
                },
                "chunk": {"type": "integer", "multipleOf": 8},
                "scheduler": {
                    "type": "object",
                    "default": {},
                    "properties": {
                        "policy": {"type": "string", "default": "fcfs"},
                        "preemption": {"type": "boolean", "default": True},
                    },
                },
            },
        },
        "roles": {"type": "object", "maxProperties": 3, "additionalProperties": ROLE},
        "ports": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "protocol": {"type": "string", "default": "TCP"},
                },
            },
        },
        "tags": {
            "type": "array",
            "x-kubernetes-list-type": "set",
            "items": {"type": "string"},
            "x-kubernetes-validations": [
                {"rule": "self.all(t, t == t.lowerAscii())", "message": "tags must be lowercase"}
            ],
        },
        "gpus": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "integer"},
            "x-kubernetes-validations": [
                {
                    "rule": "self.all(x, self.exists_one(y, y == x))",
                    "message": "gpu ids must be distinct",
                }
            ],
        },
        "storageClass": {
            "type": "string",
            "x-kubernetes-validations": [
                {"rule": "self == oldSelf", "message": "storageClass is immutable"}
            ],
        },
        "size": {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": "^[0-9]+%$",
        },
        "nodeSelector": {
            "type": "object",
            "additionalProperties": {"type": "string", "maxLength": 10},
        },
        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "template": {
            "type": "object",
            "x-kubernetes-embedded-resource": True,
            "properties": {
                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            },
        },
        "annotation": {"type": "string", "nullable": True},
        "weights": {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
        "routing": {
            "type": "object",
            "properties": {"header": {"type": "string"}, "cookie": {"type": "string"}},
            "oneOf": [{"required": ["header"]}, {"required": ["cookie"]}],
        },
        "schedule": {"type": "string", "format": "date-time"},
        "limits": {
            "type": "object",
            "minProperties": 1,
            "x-kubernetes-validations": [
                {
                    "rule": "self.cpu != 'none'",
                    "message": "cpu must not be none",
                    "reason": "FieldValueForbidden",
                    "fieldPath": ".cpu",
                },
                {"rule": "has(self.memory)", "message": "memory too",
                 "reason": "FieldValueRequired"},
                {"rule": "self.cpu != self.gpu", "reason": "FieldValueDuplicate"},
            ],
            "properties": {"cpu": {"type": "string"}, "memory": {"type": "string"},
                           "gpu": {"type": "string"}},
        },
        "text": {
            "type": "string",
            "x-kubernetes-validations": [
                {"rule": "self.split(',').join('+') != 'a+b'", "message": "no a,b"},
                {"rule": "self.indexOf('!') < 0 && self.find('[0-9]+') != '42'",
                 "message": "no bang, no 42"},
            ],
        },
        "probe": {
            "type": "object",
            "properties": {"a": {"type": "string"}},
            "x-kubernetes-validations": [{"rule": "self.a != 'bad'"}],
        },
        "text2": {
            "type": "object",
            "x-kubernetes-validations": [
                {"rule": "self.v.size() < 3",
                 "messageExpression":
                     "self.v.size() > 4 ? 'too long: ' + self.v : string(int(self.v))",
                 "message": "fallback message"},
            ],
            "properties": {"v": {"type": "string"}},
        },
    },
}

STATUS = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": ["Pending", "Ready", "Failed"]},
        "readyReplicas": {"type": "integer", "minimum": 0},
        "conditions": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "x-kubernetes-validations": [
                    {
                        "rule": "self.status in ['True', 'False', 'Unknown']",
                        "message": "status must be True, False or Unknown",
                    },
                    {
                        "rule": "self.type != oldSelf.type || self.status != 'Unknown' || "
                        "oldSelf.status == 'Unknown'",
                        "message": "a known condition cannot become Unknown",
                    },
                ],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string"},
                    "reason": {"type": "string", "default": "Unspecified"},
                },
            },
        },
    },
}

SCHEMA = {
    "type": "object",
    "x-kubernetes-validations": [
        {"rule": "self.metadata.name != 'forbidden'", "message": "this name is reserved"}
    ],
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": SPEC,
        "status": STATUS,
    },
}


def make_crd(schema: dict | None = None, *, status: bool = True) -> dict:
    version: dict[str, Any] = {
        "name": "v1alpha1",
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema if schema is not None else SCHEMA},
    }
    if status:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.test.ketch.dev"},
        "spec": {
            "group": "test.ketch.dev",
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget",
                      "listKind": "WidgetList"},
            "versions": [version],
        },
    }


@pytest.fixture(scope="module")
def validator() -> CRDValidator:
    return CRDValidator(make_crd(), "v1alpha1")


def widget(**spec: Any) -> dict:
    base: dict[str, Any] = {"image": "vllm:1", "model": {"uri": "hf://org/model"}}
    base.update(spec)
    return {
        "apiVersion": "test.ketch.dev/v1alpha1",
        "kind": "Widget",
        "metadata": {"name": "w1", "namespace": "default", "labels": {"a": "b"}},
        "spec": base,
    }


def messages(result: AdmitResult) -> list[str]:
    return [f"{c['field']}: {c['message']}" for c in result.causes]


def only_error(validator: CRDValidator, obj: dict, old: dict | None = None, **kw: Any) -> str:
    result = validator.admit(obj, old, **kw)
    assert len(result.causes) == 1, messages(result)
    return messages(result)[0]


# ----------------------------------------------------------------------------------------------
# Defaulting and pruning


def test_defaults_are_applied_recursively(validator: CRDValidator) -> None:
    obj = widget(roles={"prefill": {"tolerations": [{"key": "gpu"}]}, "decode": {}},
                 ports=[{"name": "http", "port": 80}])
    original = copy.deepcopy(obj)
    result = validator.admit(obj, None)
    assert result.causes == []
    assert result.unknown_fields == []
    assert obj == original, "admit must not mutate its input"
    spec = result.obj["spec"]
    assert spec["model"] == {"uri": "hf://org/model", "revision": "main"}
    assert spec["minReplicas"] == 1 and spec["maxReplicas"] == 3
    # engine: {} default, then its own property defaults, then the default inside the default
    assert spec["engine"] == {
        "blockSize": 16,
        "maxNumSeqs": 256,
        "gpuMemoryUtilization": 0.9,
        "dtype": "auto",
        "scheduler": {"policy": "fcfs", "preemption": True},
    }
    # additionalProperties map values and array items are defaulted too
    assert spec["roles"]["prefill"] == {
        "tolerations": [{"key": "gpu", "operator": "Equal"}],
        "replicas": 1,
    }
    assert spec["roles"]["decode"] == {"replicas": 1}
    assert spec["ports"] == [{"name": "http", "port": 80, "protocol": "TCP"}]
    assert result.obj["metadata"] == original["metadata"]
    assert result.obj["apiVersion"] == original["apiVersion"]


def test_explicit_values_win_over_defaults(validator: CRDValidator) -> None:
    obj = widget(minReplicas=0, engine={"blockSize": 64, "scheduler": {"policy": "lifo"}})
    result = validator.admit(obj, None)
    assert result.causes == []
    engine = result.obj["spec"]["engine"]
    assert engine["blockSize"] == 64
    assert engine["scheduler"] == {"policy": "lifo", "preemption": True}
    assert result.obj["spec"]["minReplicas"] == 0


def test_null_handling(validator: CRDValidator) -> None:
    # non-nullable null with a default -> defaulted; without -> dropped; nullable -> kept
    obj = widget(minReplicas=None, image=None, imageRef={"name": "x"}, annotation=None,
                 tags=None)
    result = validator.admit(obj, None)
    assert result.causes == []
    spec = result.obj["spec"]
    assert spec["minReplicas"] == 1
    assert "image" not in spec and "tags" not in spec
    assert "annotation" in spec and spec["annotation"] is None
    # a null array item is a type error (nothing prunes it)
    msg = validator.admit(widget(gpus=[1, None]), None).causes[0]
    assert f"{msg['field']}: {msg['message']}" == (
        'spec.gpus[1]: Invalid value: "null": spec.gpus[1] in body must be of type integer: '
        '"null"'
    )


def test_unknown_fields_are_pruned_and_reported(validator: CRDValidator) -> None:
    obj = widget(
        foo=1,
        model={"uri": "hf://a/b", "bar": {"x": 1}},
        roles={"mixed": {"bar": 2, "tolerations": [{"key": "k", "baz": 3}]}},
        extra={"anything": {"goes": [1, 2]}},
        template={
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "labels": {"x": "y"}},
            "spec": {"containers": [{"name": "c"}]},
            "junk": True,
        },
    )
    obj["topLevelJunk"] = 1
    result = validator.admit(obj, None)
    assert result.causes == []
    assert sorted(result.unknown_fields) == sorted([
        "topLevelJunk",
        "spec.foo",
        "spec.model.bar",
        "spec.roles.mixed.bar",
        "spec.roles.mixed.tolerations[0].baz",
        "spec.template.junk",
    ])
    spec = result.obj["spec"]
    assert "topLevelJunk" not in result.obj and "foo" not in spec
    assert spec["model"] == {"uri": "hf://a/b", "revision": "main"}
    assert spec["roles"]["mixed"]["tolerations"] == [{"key": "k", "operator": "Equal"}]
    assert spec["extra"] == {"anything": {"goes": [1, 2]}}
    # an embedded resource keeps apiVersion/kind/metadata without declaring them
    assert spec["template"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "labels": {"x": "y"}},
        "spec": {"containers": [{"name": "c"}]},
    }
    # field_validation does not change what admission returns
    strict = validator.admit(obj, None, field_validation="Ignore")
    assert strict.unknown_fields == result.unknown_fields and strict.obj == result.obj


def test_integral_float_for_integer_is_accepted_and_stored_as_int(
    validator: CRDValidator,
) -> None:
    result = validator.admit(widget(maxReplicas=5.0), None)
    assert result.causes == []
    assert result.obj["spec"]["maxReplicas"] == 5
    assert type(result.obj["spec"]["maxReplicas"]) is int


# ----------------------------------------------------------------------------------------------
# OpenAPI schema errors: exact messages and reasons


@pytest.mark.parametrize(
    ("spec", "reason", "expected"),
    [
        (
            {"engine": {"blockSize": 48}},
            "FieldValueNotSupported",
            'spec.engine.blockSize: Unsupported value: 48: supported values: "16", "32", "64", '
            '"128"',
        ),
        (
            {"engine": {"dtype": "fp8"}},
            "FieldValueNotSupported",
            'spec.engine.dtype: Unsupported value: "fp8": supported values: "auto", "float16", '
            '"bfloat16"',
        ),
        (
            {"model": {}},
            "FieldValueRequired",
            "spec.model.uri: Required value",
        ),
        (
            {"engine": {"maxNumSeqs": "string"}},
            "FieldValueTypeInvalid",
            'spec.engine.maxNumSeqs: Invalid value: "string": spec.engine.maxNumSeqs in body must '
            'be of type integer: "string"',
        ),
        (
            {"image": 5},
            "FieldValueTypeInvalid",
            'spec.image: Invalid value: "integer": spec.image in body must be of type string: '
            '"integer"',
        ),
        (
            {"engine": {"scheduler": []}},
            "FieldValueTypeInvalid",
            'spec.engine.scheduler: Invalid value: "array": spec.engine.scheduler in body must be '
            'of type object: "array"',
        ),
        (
            {"image": "this-image-name-is-too-long"},
            "FieldValueTooLong",
            "spec.image: Too long: may not be more than 20 bytes",
        ),
        (
            {"roles": {"a": {"tolerations": [{}, {}, {}, {}]}}},
            "FieldValueTooMany",
            "spec.roles.a.tolerations: Too many: 4: must have at most 3 items",
        ),
        (
            {"roles": {"a": {}, "b": {}, "c": {}, "d": {}}},
            "FieldValueTooMany",
            "spec.roles: Too many: 4: must have at most 3 items",
        ),
        (
            {"nodeSelector": {"zone": "much-too-long"}},
            "FieldValueTooLong",
            "spec.nodeSelector.zone: Too long: may not be more than 10 bytes",
        ),
        (
            {"size": True},
            "FieldValueTypeInvalid",
            'spec.size: Invalid value: "boolean": spec.size in body must be of type '
            'integer,string: "boolean"',
        ),
        (
            {"schedule": "yesterday"},
            "FieldValueTypeInvalid",
            'spec.schedule: Invalid value: "yesterday": spec.schedule in body must be of type '
            'date-time: "yesterday"',
        ),
    ],
)
def test_blocking_schema_errors(
    validator: CRDValidator, spec: dict, reason: str, expected: str
) -> None:
    result = validator.admit(widget(**spec), None)
    msgs = messages(result)
    assert msgs[0] == expected, msgs
    assert result.causes[0]["reason"] == reason
    # CEL rules are skipped after such errors, exactly like the server says
    assert msgs[-1] == BLOCKED


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"roles": {"mixed": {"replicas": -1}}},
            "spec.roles.mixed.replicas: Invalid value: -1: spec.roles.mixed.replicas in body "
            "should be greater than or equal to 0",
        ),
        (
            {"model": {"uri": "x"}},
            'spec.model.uri: Invalid value: "x": spec.model.uri in body should match '
            "'^(hf|s3)://[a-z0-9./_-]+$'",
        ),
        (
            {"image": "ab"},
            'spec.image: Invalid value: "ab": spec.image in body should be at least 3 chars long',
        ),
        (
            {"maxReplicas": 101},
            "spec.maxReplicas: Invalid value: 101: spec.maxReplicas in body should be less than "
            "or equal to 100",
        ),
        (
            {"engine": {"gpuMemoryUtilization": 0}},
            "spec.engine.gpuMemoryUtilization: Invalid value: 0: "
            "spec.engine.gpuMemoryUtilization in body should be greater than 0",
        ),
        (
            {"engine": {"gpuMemoryUtilization": 1.5}},
            "spec.engine.gpuMemoryUtilization: Invalid value: 1.5: "
            "spec.engine.gpuMemoryUtilization in body should be less than or equal to 1",
        ),
        (
            {"engine": {"chunk": 12}},
            "spec.engine.chunk: Invalid value: 12: spec.engine.chunk in body should be a multiple "
            "of 8",
        ),
        (
            {"gpus": []},
            "spec.gpus: Invalid value: 0: spec.gpus in body should have at least 1 items",
        ),
        (
            {"weights": [0.5, 0.5]},
            'spec.weights: Invalid value: "": spec.weights in body shouldn\'t contain duplicates',
        ),
        (
            {"size": "50"},
            'spec.size: Invalid value: "50": spec.size in body should match \'^[0-9]+%$\'',
        ),
        (
            {"engine": {"maxNumSeqs": 2**31}},
            '<nil>: Invalid value: "": Checked value must be of type integer with format int32 '
            "in spec.engine.maxNumSeqs",
        ),
        (
            {"ports": [{"name": "http"}, {"name": "grpc"}, {"name": "http", "port": 2}]},
            'spec.ports[2]: Duplicate value: map[string]interface {}{"name":"http"}',
        ),
        (
            {"tags": ["a", "b", "a"]},
            'spec.tags[2]: Duplicate value: "a"',
        ),
    ],
)
def test_non_blocking_schema_errors(validator: CRDValidator, spec: dict, expected: str) -> None:
    # these do not stop CEL, and the object is otherwise valid, so this is the only cause
    assert only_error(validator, widget(**spec)) == expected


def test_min_properties_does_not_block_cel(validator: CRDValidator) -> None:
    msgs = messages(validator.admit(widget(limits={}), None))
    assert msgs[0] == (
        "spec.limits: Invalid value: 0: spec.limits in body should have at least 1 properties"
    )
    assert msgs[1] == (
        'spec.limits: Invalid value: "object": no such key: cpu evaluating rule: cpu must not '
        "be none"
    )


def test_reasons_of_non_blocking_errors(validator: CRDValidator) -> None:
    dup = validator.admit(widget(tags=["a", "a"]), None).causes[0]
    assert dup["reason"] == "FieldValueDuplicate" and dup["field"] == "spec.tags[1]"
    inv = validator.admit(widget(maxReplicas=101), None).causes[0]
    assert inv["reason"] == "FieldValueInvalid" and inv["field"] == "spec.maxReplicas"


def test_int_or_string_accepts_both(validator: CRDValidator) -> None:
    assert validator.admit(widget(size=3), None).causes == []
    assert validator.admit(widget(size="30%"), None).causes == []


def test_one_of(validator: CRDValidator) -> None:
    assert validator.admit(widget(routing={"header": "x"}), None).causes == []
    both = messages(validator.admit(widget(routing={"header": "x", "cookie": "y"}), None))
    assert both == [
        '<nil>: Invalid value: "": "spec.routing" must validate one and only one schema '
        "(oneOf). Found 2 valid alternatives"
    ]
    none = messages(validator.admit(widget(routing={}), None))
    assert none[0] == (
        '<nil>: Invalid value: "": "spec.routing" must validate one and only one schema '
        "(oneOf). Found none valid"
    )
    assert none[1] == "spec.routing.header: Required value"


def test_several_errors_are_all_reported_in_order(validator: CRDValidator) -> None:
    obj = widget(maxReplicas=0, roles={"x": {"replicas": -2}}, model={"uri": "nope"})
    result = validator.admit(obj, None)
    assert messages(result) == [
        'spec.model.uri: Invalid value: "nope": spec.model.uri in body should match '
        "'^(hf|s3)://[a-z0-9./_-]+$'",
        "spec.maxReplicas: Invalid value: 0: spec.maxReplicas in body should be greater than "
        "or equal to 1",
        "spec.roles.x.replicas: Invalid value: -2: spec.roles.x.replicas in body should be "
        "greater than or equal to 0",
        # CEL still runs (no blocking error): minReplicas (default 1) > maxReplicas 0
        'spec.minReplicas: Invalid value: "object": minReplicas must not exceed maxReplicas',
    ]


def test_metadata_name_length(validator: CRDValidator) -> None:
    obj = widget()
    obj["metadata"]["name"] = "w" * 254
    assert only_error(validator, obj) == (
        f'metadata.name: Invalid value: "{"w" * 254}": must be no more than 253 characters'
    )
    obj["metadata"]["name"] = "w" * 253
    assert validator.admit(obj, None).causes == []


# ----------------------------------------------------------------------------------------------
# CEL rules


def test_cel_cross_field_xor(validator: CRDValidator) -> None:
    both = widget(imageRef={"name": "x"})
    neither = widget()
    del neither["spec"]["image"]
    for obj in (both, neither):
        result = validator.admit(obj, None)
        assert messages(result) == [
            'spec: Invalid value: "object": exactly one of image or imageRef must be set'
        ]
        assert result.causes[0]["reason"] == "FieldValueInvalid"


def test_cel_min_le_max_with_field_path(validator: CRDValidator) -> None:
    assert only_error(validator, widget(minReplicas=5, maxReplicas=4)) == (
        'spec.minReplicas: Invalid value: "object": minReplicas must not exceed maxReplicas'
    )
    # defaults take part: minReplicas 4 > default maxReplicas 3
    assert only_error(validator, widget(minReplicas=4)).startswith("spec.minReplicas: ")
    assert validator.admit(widget(minReplicas=3), None).causes == []


def test_cel_list_all_distinct(validator: CRDValidator) -> None:
    assert validator.admit(widget(gpus=[0, 1, 2]), None).causes == []
    assert only_error(validator, widget(gpus=[0, 1, 0])) == (
        'spec.gpus: Invalid value: "array": gpu ids must be distinct'
    )


def test_cel_transition_rule_with_old_self(validator: CRDValidator) -> None:
    old = validator.admit(widget(storageClass="fast"), None).obj
    # create: no old object -> the transition rule is not evaluated
    assert validator.admit(widget(storageClass="slow"), None).causes == []
    # update with a change -> rejected; without -> accepted
    assert only_error(validator, widget(storageClass="slow"), old) == (
        'spec.storageClass: Invalid value: "string": storageClass is immutable'
    )
    assert validator.admit(widget(storageClass="fast"), old).causes == []
    # update where the old object had no value there -> not evaluated
    old_without = validator.admit(widget(), None).obj
    assert validator.admit(widget(storageClass="slow"), old_without).causes == []


def test_cel_transition_rule_on_list_map_items(validator: CRDValidator) -> None:
    """Items of a list-type=map correlate with the old item of the same key."""
    old = {"conditions": [{"type": "Ready", "status": "True"},
                          {"type": "Synced", "status": "Unknown"}]}
    new = {"conditions": [{"type": "Synced", "status": "Unknown"},
                          {"type": "Ready", "status": "Unknown"},
                          {"type": "New", "status": "Unknown"}]}
    old_obj = {**widget(), "status": old}
    new_obj = {**widget(), "status": new}
    result = validator.admit(new_obj, old_obj, subresource="status")
    assert messages(result) == [
        'status.conditions[1]: Invalid value: "object": a known condition cannot become Unknown'
    ]
    assert result.obj["status"]["conditions"][2]["reason"] == "Unspecified"


def test_cel_message_expression(validator: CRDValidator) -> None:
    assert only_error(validator, widget(roles={"big": {"replicas": 9}})) == (
        'spec.roles[big]: Invalid value: "object": replicas is 9, at most 8'
    )
    # a messageExpression that errors falls back to message
    assert only_error(validator, widget(text2={"v": "abc"})) == (
        'spec.text2: Invalid value: "object": fallback message'
    )
    assert only_error(validator, widget(text2={"v": "abcde"})) == (
        'spec.text2: Invalid value: "object": too long: abcde'
    )


def test_cel_rules_on_list_items_use_element_paths(validator: CRDValidator) -> None:
    obj = widget(roles={"prefill": {"tolerations": [
        {"key": "a", "operator": "Exists"},
        {"key": "b", "operator": "Exists", "value": "x"},
        {"key": "c", "value": "y"},
    ]}})
    assert only_error(validator, obj) == (
        'spec.roles[prefill].tolerations[1].value: Invalid value: "object": value must be empty '
        "when operator is Exists"
    )


def test_cel_rule_reasons(validator: CRDValidator) -> None:
    result = validator.admit(widget(limits={"cpu": "none", "gpu": "none"}), None)
    assert [(c["reason"], c["field"], c["message"]) for c in result.causes] == [
        ("FieldValueForbidden", "spec.limits.cpu", "Forbidden: cpu must not be none"),
        ("FieldValueRequired", "spec.limits", "Required value: memory too"),
        ("FieldValueDuplicate", "spec.limits", 'Duplicate value: "object"'),
    ]


def test_cel_default_message_escaped_names_and_extension_functions(
    validator: CRDValidator,
) -> None:
    assert only_error(validator, widget(**{"max-tokens": 3})) == (
        'spec: Invalid value: "object": failed rule: '
        "!has(self.max__dash__tokens) || self.max__dash__tokens % 2 == 0"
    )
    assert validator.admit(widget(**{"max-tokens": 4}), None).causes == []
    assert only_error(validator, widget(tags=["ok", "Bad"])) == (
        'spec.tags: Invalid value: "array": tags must be lowercase'
    )
    assert only_error(validator, widget(text="a,b")).endswith('"string": no a,b')
    assert only_error(validator, widget(text="x!")).endswith('"string": no bang, no 42')
    assert only_error(validator, widget(text="x42y")).endswith('"string": no bang, no 42')


@pytest.mark.parametrize(
    "expr",
    [
        "[1, 2, 2].isSorted() && ![2, 1].isSorted()",
        "[3, 1, 2].max() == 3 && [3, 1, 2].min() == 1 && [1, 2].sum() == 3",
        "[1, 2, 3].indexOf(2) == 1 && [1, 2, 1].lastIndexOf(1) == 2",
        "'a.b.c'.indexOf('.') == 1 && 'a.b.c'.lastIndexOf('.') == 3",
        "'Hello'.upperAscii() == 'HELLO' && 'Hello'.lowerAscii() == 'hello'",
        "' x '.trim() == 'x' && 'abc'.substring(1) == 'bc' && 'abc'.charAt(1) == 'b'",
        "'a,b,c'.split(',', 2) == ['a', 'b,c'] && 'aaa'.replace('a', 'b', 2) == 'bba'",
        "['a', 'b'].join('-') == 'a-b' && 'abc'.reverse() == 'cba'",
        "'abc123def45'.findAll('[0-9]+') == ['123', '45'] && 'x1'.find('[0-9]') == '1'",
        "'abc'.matches('^a.c$') && 'abc'.contains('b') && 'abc'.startsWith('ab')",
        "'abc'.endsWith('bc') && size('abc') == 3 && 'k' in {'k': 1} && 2 in [1, 2]",
        "int('12') + 1 == 13 && string(12) == '12' && double('1.5') == 1.5",
        "[1, 2, 3].map(v, v * 2).filter(v, v > 2) == [4, 6]",
        "[1, 2, 3].exists_one(v, v == 2) && [1, 2].exists(v, v == 2) && [1].all(v, v == 1)",
        "{'a': 1, 'b': 2}.all(k, k in ['a', 'b'])",
        "true ? 1 == 1 : 1 / 0 == 1",
        "duration('1h') > duration('30m')",
        "timestamp('2024-01-01T00:00:00Z') < timestamp('2025-01-01T00:00:00Z')",
        "quantity('1Gi').isGreaterThan(quantity('500Mi')) && quantity('1Gi') == quantity('1024Mi')",
        "quantity('2').isInteger() && !quantity('1.5').isInteger()",
        "quantity('1e3').asInteger() == 1000 && quantity('100m').asApproximateFloat() == 0.1",
        "quantity('1Gi').add(quantity('1Gi')).compareTo(quantity('2Gi')) == 0",
        "quantity('5').sub(2).asInteger() == 3 && quantity('-1').sign() == -1",
        "isQuantity('250m') && !isQuantity('abc')",
    ],
)
def test_cel_supported_functions(expr: str) -> None:
    v = CRDValidator(_with_spec_rule({"rule": expr}), "v1alpha1")
    assert v.admit(widget(), None).causes == []
    negated = CRDValidator(_with_spec_rule({"rule": f"!({expr})"}), "v1alpha1")
    assert messages(negated.admit(widget(), None)) == [
        f'spec: Invalid value: "object": failed rule: !({expr})'
    ]


def test_cel_quantity_on_object_fields() -> None:
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["spec"]["properties"]["memory"] = {
        "type": "string",
        "x-kubernetes-validations": [
            {"rule": "isQuantity(self) && quantity(self).isLessThan(quantity('80Gi'))",
             "message": "memory must be a quantity below 80Gi"}
        ],
    }
    v = CRDValidator(make_crd(schema), "v1alpha1")
    assert v.admit(widget(memory="40Gi"), None).causes == []
    for bad in ("80Gi", "lots"):
        assert only_error(v, widget(memory=bad)) == (
            'spec.memory: Invalid value: "string": memory must be a quantity below 80Gi'
        )


def test_cel_evaluation_error_is_a_validation_failure() -> None:
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["spec"]["properties"]["text"]["x-kubernetes-validations"] = [
        {"rule": "self.size() > 0 && {'a': 1}[self] == 1"}
    ]
    v = CRDValidator(make_crd(schema), "v1alpha1")
    assert only_error(v, widget(text="b")) == (
        'spec.text: Invalid value: "string": no such key: b evaluating rule: '
        "self.size() > 0 && {'a': 1}[self] == 1"
    )
    assert v.admit(widget(text="a"), None).causes == []


def test_cel_root_rule_sees_metadata_name(validator: CRDValidator) -> None:
    obj = widget()
    obj["metadata"]["name"] = "forbidden"
    result = validator.admit(obj, None)
    assert messages(result) == ['<nil>: Invalid value: "object": this name is reserved']


def test_cel_rules_skip_absent_nodes_and_report_missing_keys(validator: CRDValidator) -> None:
    # probe's rule reads self.a: not evaluated without probe, an error without probe.a
    assert validator.admit(widget(), None).causes == []
    assert validator.admit(widget(probe={"a": "ok"}), None).causes == []
    assert only_error(validator, widget(probe={"a": "bad"})) == (
        "spec.probe: Invalid value: \"object\": failed rule: self.a != 'bad'"
    )
    assert only_error(validator, widget(probe={})) == (
        "spec.probe: Invalid value: \"object\": no such key: a evaluating rule: self.a != 'bad'"
    )


# ----------------------------------------------------------------------------------------------
# Status subresource


def test_status_is_left_alone_on_main_resource(validator: CRDValidator) -> None:
    obj = widget()
    obj["status"] = {"phase": "Bogus", "junk": 1, "readyReplicas": -5}
    result = validator.admit(obj, None)
    assert result.causes == []
    assert result.unknown_fields == []
    assert result.obj["status"] == obj["status"]


def test_status_subresource_validates_only_status(validator: CRDValidator) -> None:
    obj = widget(maxReplicas=1000, foo=1)  # invalid spec is not looked at
    obj["status"] = {"phase": "Bogus", "junk": 1, "readyReplicas": -5,
                     "conditions": [{"type": "Ready", "status": "Maybe"}]}
    result = validator.admit(obj, None, subresource="status")
    assert messages(result) == [
        'status.phase: Unsupported value: "Bogus": supported values: "Pending", "Ready", '
        '"Failed"',
        "status.readyReplicas: Invalid value: -5: status.readyReplicas in body should be greater "
        "than or equal to 0",
        BLOCKED,
    ]
    assert result.unknown_fields == ["status.junk"]
    assert result.obj["spec"] == obj["spec"]
    assert "junk" not in result.obj["status"]
    ok = copy.deepcopy(obj)
    ok["status"] = {"phase": "Ready", "conditions": [{"type": "Ready", "status": "Maybe"}]}
    assert messages(validator.admit(ok, None, subresource="status")) == [
        'status.conditions[0]: Invalid value: "object": status must be True, False or Unknown'
    ]


def test_without_status_subresource_status_is_validated() -> None:
    v = CRDValidator(make_crd(status=False), "v1alpha1")
    obj = widget()
    obj["status"] = {"phase": "Bogus", "junk": 1}
    result = v.admit(obj, None)
    assert messages(result)[0].startswith('status.phase: Unsupported value: "Bogus"')
    assert result.unknown_fields == ["status.junk"]


# ----------------------------------------------------------------------------------------------
# Construction errors


def _with_spec_rule(rule: dict) -> dict:
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["spec"]["x-kubernetes-validations"] = [rule]
    return make_crd(schema)


@pytest.mark.parametrize(
    ("rule", "needle"),
    [
        ({"rule": "cidr(self.image).prefixLength() > 8"}, "'cidr'"),
        ({"rule": "url(self.image).getHost() == 'x'"}, "'url'"),
        ({"rule": "self.image.someMethod()"}, "'someMethod'"),
        ({"rule": "self.gpus.reduce(a, b, a + b) > 0"}, "'reduce'"),
        ({"rule": "self.image =="}, "compilation failed"),
        ({"rule": "true", "messageExpression": "ip(self.image)"}, "'ip'"),
        ({"rule": "true", "fieldPath": ".nope"}, "fieldPath"),
        ({"rule": "self.minReplica <= self.maxReplicas"}, "undefined field 'minReplica'"),
        ({"rule": "has(self.model.url)"}, "undefined field 'url'"),
        ({"rule": "self.roles.mixed.tolerations[0].kee == ''"}, "undefined field 'kee'"),
        ({"rule": "self.max-tokens > 0"}, "undefined field 'max'"),
        ({"rule": "true", "reason": "FieldValueBogus"}, "reason"),
    ],
)
def test_bad_rules_fail_at_construction(rule: dict, needle: str) -> None:
    with pytest.raises(CRDSchemaError, match=needle) as info:
        CRDValidator(_with_spec_rule(rule), "v1alpha1")
    assert "x-kubernetes-validations[0]" in str(info.value)


def test_unknown_version_fails_at_construction() -> None:
    with pytest.raises(CRDSchemaError, match="v9"):
        CRDValidator(make_crd(), "v9")


# ----------------------------------------------------------------------------------------------
# format_causes


def test_format_causes() -> None:
    a = {"reason": "FieldValueRequired", "field": "spec.a", "message": "Required value"}
    b = {"reason": "FieldValueInvalid", "field": "spec.b", "message": "Invalid value: 1: bad"}
    assert format_causes([a]) == "spec.a: Required value"
    assert format_causes([a, b, a]) == "[spec.a: Required value, spec.b: Invalid value: 1: bad]"


# ----------------------------------------------------------------------------------------------
# Property test: any valid object passes, unchanged except for the defaults


_name = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8)


@st.composite
def valid_specs(draw: st.DrawFn) -> dict:
    spec: dict[str, Any] = {}
    if draw(st.booleans()):
        spec["image"] = draw(st.text(alphabet=string.ascii_letters + ":.", min_size=3,
                                     max_size=20))
    else:
        spec["imageRef"] = {"name": draw(_name)}
    model: dict[str, Any] = {
        "uri": draw(st.sampled_from(["hf://", "s3://"]))
        + draw(st.text(alphabet=string.ascii_lowercase + string.digits + "./_-", min_size=1,
                       max_size=20))
    }
    if draw(st.booleans()):
        model["revision"] = draw(_name)
    spec["model"] = model
    # minReplicas <= maxReplicas, counting the defaults (1 and 3)
    max_replicas = draw(st.integers(1, 100)) if draw(st.booleans()) else None
    if max_replicas is not None:
        spec["maxReplicas"] = max_replicas
    if draw(st.booleans()):
        spec["minReplicas"] = draw(st.integers(0, max_replicas or 3))
    if draw(st.booleans()):
        engine: dict[str, Any] = {}
        if draw(st.booleans()):
            engine["blockSize"] = draw(st.sampled_from([16, 32, 64, 128]))
        if draw(st.booleans()):
            engine["maxNumSeqs"] = draw(st.integers(-(2**31), 2**31 - 1))
        if draw(st.booleans()):
            engine["gpuMemoryUtilization"] = draw(
                st.floats(min_value=0.01, max_value=1.0, allow_nan=False))
        if draw(st.booleans()):
            engine["dtype"] = draw(st.sampled_from(["auto", "float16", "bfloat16"]))
        if draw(st.booleans()):
            engine["chunk"] = 8 * draw(st.integers(-100, 100))
        if draw(st.booleans()):
            engine["scheduler"] = draw(st.fixed_dictionaries(
                {}, optional={"policy": _name, "preemption": st.booleans()}))
        spec["engine"] = engine
    if draw(st.booleans()):
        roles = draw(st.dictionaries(_name, st.just(None), max_size=3))
        for key in roles:
            role: dict[str, Any] = {}
            if draw(st.booleans()):
                role["replicas"] = draw(st.integers(0, 8))
            if draw(st.booleans()):
                tols = []
                for _ in range(draw(st.integers(0, 3))):
                    tol: dict[str, Any] = {"key": draw(_name)}
                    op = draw(st.sampled_from([None, "Equal", "Exists"]))
                    if op is not None:
                        tol["operator"] = op
                    if op != "Exists" and draw(st.booleans()):
                        tol["value"] = draw(_name)
                    tols.append(tol)
                role["tolerations"] = tols
            if draw(st.booleans()):
                role["env"] = draw(st.dictionaries(_name, st.text(max_size=5), max_size=3))
            roles[key] = role
        spec["roles"] = roles
    if draw(st.booleans()):
        names = draw(st.lists(_name, unique=True, max_size=4))
        ports = []
        for n in names:
            port: dict[str, Any] = {"name": n}
            if draw(st.booleans()):
                port["port"] = draw(st.integers(1, 65535))
            if draw(st.booleans()):
                port["protocol"] = draw(st.sampled_from(["TCP", "UDP"]))
            ports.append(port)
        spec["ports"] = ports
    if draw(st.booleans()):
        spec["tags"] = draw(st.lists(_name, unique=True, max_size=4))
    if draw(st.booleans()):
        spec["gpus"] = draw(st.lists(st.integers(0, 64), unique=True, min_size=1, max_size=4))
    if draw(st.booleans()):
        spec["size"] = draw(st.one_of(st.integers(0, 1000),
                                      st.integers(0, 100).map(lambda i: f"{i}%")))
    if draw(st.booleans()):
        spec["nodeSelector"] = draw(st.dictionaries(_name, st.text(max_size=10), max_size=3))
    if draw(st.booleans()):
        spec["extra"] = draw(st.dictionaries(_name, st.one_of(st.integers(), st.text(),
                                                               st.none()), max_size=3))
    if draw(st.booleans()):
        spec["annotation"] = draw(st.one_of(st.none(), st.text(max_size=10)))
    if draw(st.booleans()):
        spec["weights"] = draw(st.lists(st.floats(allow_nan=False, allow_infinity=False),
                                        unique=True, max_size=4))
    if draw(st.booleans()):
        spec["routing"] = {draw(st.sampled_from(["header", "cookie"])): draw(_name)}
    if draw(st.booleans()):
        spec["storageClass"] = draw(_name)
    return spec


def expected_after_defaults(spec: dict) -> dict:
    """The test's own statement of which defaults the schema implies (an independent oracle)."""
    out = copy.deepcopy(spec)
    out["model"].setdefault("revision", "main")
    out.setdefault("minReplicas", 1)
    out.setdefault("maxReplicas", 3)
    engine = out.setdefault("engine", {})
    engine.setdefault("blockSize", 16)
    engine.setdefault("maxNumSeqs", 256)
    engine.setdefault("gpuMemoryUtilization", 0.9)
    engine.setdefault("dtype", "auto")
    scheduler = engine.setdefault("scheduler", {})
    scheduler.setdefault("policy", "fcfs")
    scheduler.setdefault("preemption", True)
    for role in out.get("roles", {}).values():
        role.setdefault("replicas", 1)
        for tol in role.get("tolerations", []):
            tol.setdefault("operator", "Equal")
    for port in out.get("ports", []):
        port.setdefault("protocol", "TCP")
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=valid_specs())
def test_valid_objects_pass_unchanged_except_defaults(spec: dict) -> None:
    validator = _SHARED_VALIDATOR
    obj = widget()
    obj["spec"] = spec
    before = copy.deepcopy(obj)
    result = validator.admit(obj, None)
    assert result.causes == [], messages(result)
    assert result.unknown_fields == []
    assert obj == before
    assert result.obj["spec"] == expected_after_defaults(spec)
    assert {k: v for k, v in result.obj.items() if k != "spec"} == {
        k: v for k, v in before.items() if k != "spec"}
    # admitting the stored object again (an update without changes) is a no-op
    again = validator.admit(result.obj, result.obj)
    assert again.causes == [] and again.obj == result.obj


_SHARED_VALIDATOR = CRDValidator(make_crd(), "v1alpha1")
