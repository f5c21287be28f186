"""The CEL cost estimator prices rules as kube-apiserver does, and the emulator refuses a CRD over
the budget with kube-apiserver's message.

The expected costs of the first test are kube-apiserver's own (``TestCostEstimation`` in
apiextensions-apiserver ``pkg/apiserver/schema/cel/compilation_test.go``): the same schemas
and rules, once unbounded and once with maxItems/maxLength/maxProperties set.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kubeemu import Emulator, cel_ast, cel_types, crd_budget
from kubeemu.cel_cost import estimate_rule
from kubeemu.cel_estimate import CostNotModelled
from kubeemu.cel_runtime import CelParser

Schema = dict[str, Any]


def cost(schema: Schema, rule: str) -> int:
    root = cel_types.schema_decl_type(schema)
    assert root is not None
    return estimate_rule(cel_ast.parse(CelParser.get().parse(rule)), root).hi


def prim(kind: str, max_length: int | None = None) -> Schema:
    if kind == "int-or-string":
        out: Schema = {"x-kubernetes-int-or-string": True}
    elif kind in ("duration", "date", "date-time"):
        out = {"type": "string", "format": kind}
    else:
        out = {"type": kind}
    if max_length is not None:
        out["maxLength"] = max_length
    return out


def array(items: Schema, max_items: int | None = None) -> Schema:
    out: Schema = {"type": "array", "items": items}
    if max_items is not None:
        out["maxItems"] = max_items
    return out


def mapping(values: Schema, max_properties: int | None = None) -> Schema:
    out: Schema = {"type": "object", "additionalProperties": values}
    if max_properties is not None:
        out["maxProperties"] = max_properties
    return out


OBJ = {
    "type": "object",
    "properties": {"required": {"type": "string"}, "optional": {"type": "string"}},
    "required": ["required"],
}
Gen = Callable[[int | None], Schema]


def strings_obj(m: int | None) -> Schema:
    return {
        "type": "object",
        "properties": {
            "str": prim("string", m),
            "before": prim("string", 2),
            "after": prim("string", 4),
        },
    }


def split_obj(m: int | None) -> Schema:
    return {
        "type": "object",
        "properties": {"str": prim("string", m), "separator": prim("string", m)},
    }


def enum(m: int | None) -> Schema:
    return {**prim("string", m), "enum": ["A", "B", "C", "LongValue"]}


# (schema for a bound, rule, cost unbounded (None: over 1e7), bound, cost bounded)
REFERENCE: list[tuple[Gen, str, int | None, int, int]] = [
    (lambda m: array(prim("number"), m), "self.all(x, true)", 4718591, 10, 32),
    (lambda m: array(prim("string"), m), "self.all(x, true)", 3145727, 20, 62),
    (lambda m: array(prim("boolean"), m), "self.all(x, true)", 1887437, 5, 17),
    (lambda m: array(array(prim("number")), m), "self.all(x, true)", 3145727, 100, 302),
    (lambda m: array(OBJ, m), "self.all(x, true)", 555128, 50, 152),
    (lambda m: mapping(prim("number"), m), "self.all(x, true)", 1348169, 10, 32),
    (lambda m: mapping(prim("string"), m), "self.all(x, true)", 1179647, 3, 11),
    (lambda m: mapping(prim("boolean"), m), "self.all(x, true)", 943718, 100, 302),
    (lambda m: prim("string", m), "self.contains('test')", 314574, 10, 5),
    (lambda m: prim("string", m), "self.startsWith('test')", 2, 15, 2),
    (lambda m: prim("string", m), 'size(self + "hello") > size("hello")', 314578, 4, 7),
    (lambda m: array(prim("number"), m), "self[1] == 0.0", 2, 5000, 2),
    (lambda m: array(prim("string"), m), "self[1] == self[1]", 314577, 8, 314577),
    (lambda m: array(prim("number"), m), "self.all(x, self.all(y, true))", None, 10, 352),
    (
        lambda m: array(prim("number"), m),
        "self.all(x, self.all(y, self.all(z, true)))",
        None,
        10,
        3552,
    ),
    (lambda m: prim("string", m), 'self.matches("x")', 314574, 50, 22),
    (lambda m: prim("string", m), '"".matches("(((((((((())))))))))[0-9]")', 7, 10, 7),
    (lambda m: prim("string", m), 'self.matches("")', 1, 100, 1),
    (
        lambda m: {**mapping(prim("string", m), m)},
        "self.all(x, x.contains(self[x]))",
        2752507,
        10,
        72,
    ),
    (lambda m: prim("string", m), 'self == "x"', 2, 0, 1),
    (lambda m: array(prim("number"), m), "self[3] == 0.0", 2, 0, 2),
    (
        lambda m: array(prim("number"), m),
        "self.all(x, x == 0.0)",
        6291454,
        3 * 1024 * 2048,
        25165826,
    ),
    (lambda m: array(prim("int-or-string"), m), "self.all(x, true)", 4718591, 10, 32),
    (lambda m: array(prim("int-or-string"), m), "self[0] == 5", 3, 10, 3),
    (lambda m: array(prim("boolean"), m), "self[0] == false", 2, 25, 2),
    (lambda m: array(OBJ, m), "self[0] == null", 2, 422, 2),
    (lambda m: array(array(prim("number")), m), "self[0][0] == -1.0", 3, 51, 3),
    (lambda m: array(mapping(prim("number")), m), "self.all(x, x.y == 25.2)", 6291452, 12, 74),
    (lambda m: array(mapping(prim("number")), m), "self[0].x > 2.0", 4, 3000, 4),
    (lambda m: array(prim("duration"), m), "self.all(x, true)", 2359295, 5, 17),
    (lambda m: array(prim("duration"), m), "self[0].getHours() == 2", 4, 525, 4),
    (lambda m: array(prim("date"), m), "self.all(x, true)", 725936, 15, 47),
    (lambda m: array(prim("date-time"), m), "self.all(x, true)", 428963, 25, 77),
    (lambda m: mapping(prim("int-or-string"), m), "self.all(x, true)", 1348169, 15, 47),
    (lambda m: mapping(OBJ, m), "self.all(x, true)", 428963, 20, 62),
    (lambda m: mapping(mapping(prim("number")), m), "self.all(x, true)", 1179647, 10, 32),
    (lambda m: mapping(array(prim("number")), m), "self.all(x, true)", 1179647, 25, 77),
    (lambda m: mapping(prim("duration"), m), "self.all(x, true)", 1048577, 5, 17),
    (lambda m: mapping(prim("date"), m), "self.all(x, true)", 524288, 10, 32),
    (lambda m: mapping(prim("date-time"), m), "self.all(x, true)", 349526, 25, 77),
    (lambda m: prim("string", m), "self.find('[0-9]+') == ''", 629147, 10, 11),
    (lambda m: array(prim("string", m), m), "self.join(' ') == 'aa bb'", 329853068905, 10, 43),
    (lambda m: array(prim("string", m), m), "self.isSorted() == true", 329854432052, 10, 52),
    (
        strings_obj,
        "self.str.replace(self.before, self.after) == 'does not matter'",
        629154,
        4,
        12,
    ),
    (split_obj, "self.str.split(self.separator) == []", 629160, 10, 22),
    (lambda m: prim("string", m), "self.lowerAscii() == 'lower!'", 314575, 10, 6),
    (lambda m: mapping(prim("integer"), m), "oldSelf.size() == self.size()", 5, 10, 5),
    (lambda m: mapping(prim("date-time"), m), 'self["a"] == self["b"]', 8, 7, 8),
    (lambda m: mapping(prim("duration"), m), 'self["c"] == self["d"]', 8, 42, 8),
    (enum, "self.contains('A')", 2, 1000, 401),
    (lambda m: prim("int-or-string", m), "isQuantity(self)", 314574, 20, 9),
]


@pytest.mark.parametrize(("gen", "rule", "unbounded", "bound", "bounded"), REFERENCE)
def test_costs_are_kube_apiservers(
    gen: Gen, rule: str, unbounded: int | None, bound: int, bounded: int
) -> None:
    if unbounded is None:
        assert cost(gen(None), rule) > crd_budget.STATIC_ESTIMATED_COST_LIMIT
    else:
        assert cost(gen(None), rule) == unbounded
    assert cost(gen(bound), rule) == bounded


def test_matches_costs_the_string_times_the_regex() -> None:
    """ceil((1 + len) * 0.1) * ceil(len(regex) * 0.25), plus 1 for reading self."""
    regex = "a" * 400
    assert cost(prim("string", 250), f"self.matches('{regex}')") == 101 * 100 + 1
    unbounded = cost(prim("string"), f"self.matches('{regex}')")
    assert unbounded == (3 * 1024 * 1024 - 2 + 1 + 9) // 10 * 100 + 1


@pytest.mark.parametrize(
    "rule",
    [
        "url(self[0]).getHost() == 'x'",  # a library the estimator does not model
        "self.all(i, v, v != '')",  # two-variable comprehensions
        "self[0].nosuchfield == 'x'",  # no such field (the apiserver's checker refuses it too)
        "self.exists(a, a.format(['x']) == 'x')",
    ],
)
def test_constructs_outside_the_model_raise(rule: str) -> None:
    with pytest.raises((CostNotModelled, cel_ast.CelSyntaxError)):
        cost(array(prim("string", 10), 5), rule)


# --------------------------------------------------------------------------- per CRD


def crd(schema: Schema, versions: tuple[str, ...] = ("v1",)) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "gadgets.budget.example.com"},
        "spec": {
            "group": "budget.example.com",
            "scope": "Namespaced",
            "names": {
                "kind": "Gadget",
                "listKind": "GadgetList",
                "plural": "gadgets",
                "singular": "gadget",
            },
            "versions": [
                {
                    "name": v,
                    "served": True,
                    "storage": i == 0,
                    "schema": {"openAPIV3Schema": copy.deepcopy(schema)},
                }
                for i, v in enumerate(versions)
            ],
        },
    }


def root(spec: Schema) -> Schema:
    return {"type": "object", "properties": {"spec": spec}}


def with_rule(schema: Schema, rule: str) -> Schema:
    return {**schema, "x-kubernetes-validations": [{"rule": rule}]}


HINT = (
    "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, "
    "maps, and strings are declared)"
)
SPEC = "spec.validation.openAPIV3Schema.properties[spec]"


def test_a_rule_counts_once_per_item_of_the_lists_above_it() -> None:
    item = with_rule({"type": "object", "properties": {"n": {"type": "integer"}}}, "self.n > 0")
    bounded = crd_budget.schema_rule_costs(root(array(item, 7)))
    assert [(c.max_cost, c.cardinality, c.cost) for c in bounded] == [(3, 7, 21)]
    # under an unbounded list: as many as the item's smallest JSON ({}, 2 bytes) fits in 3 MiB
    unbounded = crd_budget.schema_rule_costs(root(array(item)))
    assert unbounded[0].cardinality == 3 * 1024 * 1024 // 3
    # a rule on the list itself runs once per list
    on_list = crd_budget.schema_rule_costs(root(with_rule(array(item, 7), "self.size() < 5")))
    assert on_list[-1].cardinality == 1


def test_messages_name_the_rule_and_the_factor() -> None:
    assert crd_budget.cost_error_message("estimated rule cost", 10_485_760, 10**7) == (
        f"estimated rule cost exceeds budget by factor of 1.048576x {HINT}"
    )
    assert "factor of 18.1x" in crd_budget.cost_error_message("c", 181_000_000, 10**7)
    assert "factor of more than 100x" in crd_budget.cost_error_message("c", 10**10, 10**7)


def test_a_rule_over_the_per_rule_limit_is_forbidden() -> None:
    rule = "self.all(a, a.matches('^(--port|--host|--model)(=.*)?$'))"
    spec = {"type": "object", "properties": {"args": with_rule(array(prim("string"), 8), rule)}}
    causes = crd_budget.crd_cost_causes(crd(root(spec)))
    field = f"{SPEC}.properties[args].x-kubernetes-validations[0].rule"
    assert causes == [
        {
            "reason": "FieldValueForbidden",
            "field": field,
            # 8 items * ceil((1 + 3 MiB - 2) * 0.1) * ceil(32 * 0.25) + loop: 2.0e7
            "message": f"Forbidden: estimated rule cost exceeds budget by factor of 2.0x {HINT}",
        }
    ]
    bounded = copy.deepcopy(spec)
    bounded["properties"]["args"]["items"]["maxLength"] = 128
    assert crd_budget.crd_cost_causes(crd(root(bounded))) == []


def _total_over_budget() -> Schema:
    """Eleven rules, each under 1e7 and each costlier than the next, together over 1e8."""
    regex = "x" * 400  # ceil(400 * 0.25) = 100
    props = {
        f"s{i}": with_rule(prim("string", 237_500 - 1000 * i), f"self.matches('{regex}')")
        for i in range(11)
    }
    return root({"type": "object", "properties": props})


def test_rules_over_the_total_are_forbidden_with_the_four_costliest() -> None:
    schema = _total_over_budget()
    costs = crd_budget.schema_rule_costs(schema, "spec.validation.openAPIV3Schema")
    assert all(c.cost < crd_budget.STATIC_ESTIMATED_COST_LIMIT for c in costs)
    total = sum(c.cost for c in costs)
    assert total > crd_budget.STATIC_ESTIMATED_CRD_COST_LIMIT
    causes = crd_budget.crd_cost_causes(crd(schema))
    contributed = [c["field"] for c in causes[:-1]]
    assert contributed == [
        f"{SPEC}.properties[s{i}].x-kubernetes-validations[0].rule" for i in range(4)
    ]
    assert {c["message"] for c in causes[:-1]} == {
        "Forbidden: contributed to estimated rule cost total exceeding cost limit for entire "
        "OpenAPIv3 schema"
    }
    assert causes[-1] == {
        "reason": "FieldValueForbidden",
        "field": "spec.validation.openAPIV3Schema",
        "message": "Forbidden: x-kubernetes-validations estimated rule cost total for entire "
        f"OpenAPIv3 schema exceeds budget by factor of {total / 10**8:f}x {HINT}",
    }


def test_an_unchanged_schema_keeps_its_rules_on_update_but_not_its_total() -> None:
    rule = "self.all(a, a.matches('^(--port|--host)$'))"
    spec = {"type": "object", "properties": {"args": with_rule(array(prim("string"), 8), rule)}}
    old = crd(root(spec))
    assert crd_budget.crd_cost_causes(old) != []
    assert crd_budget.crd_cost_causes(copy.deepcopy(old), old) == []  # e.g. after an upgrade
    total = crd(_total_over_budget())
    assert crd_budget.crd_cost_causes(copy.deepcopy(total), total) != []


def test_versions_with_different_schemas_are_priced_one_by_one() -> None:
    rule = "self.all(a, a.matches('^(--port|--host)$'))"
    definition = crd(root(prim("string")), versions=("v1", "v2"))
    v2 = definition["spec"]["versions"][1]["schema"]["openAPIV3Schema"]
    v2["properties"]["spec"] = with_rule(array(prim("string"), 8), rule)
    causes = crd_budget.crd_cost_causes(definition)
    assert [c["field"] for c in causes] == [
        "spec.versions[1].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule"
    ]


def test_a_rule_it_cannot_price_is_refused_not_waved_through() -> None:
    spec = with_rule(prim("string", 10), "self.url().getHost() == 'x'")
    causes = crd_budget.crd_cost_causes(crd(root(spec)))
    assert len(causes) == 1 and causes[0]["reason"] == "FieldValueInvalid"
    assert "cannot estimate the CEL cost" in causes[0]["message"]


# --------------------------------------------------------------------------- the emulator

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def test_the_emulator_refuses_a_crd_over_budget_with_the_apiservers_message(emu: Emulator) -> None:
    rule = "self.all(a, a.matches('^(--port|--host|--model)(=.*)?$'))"
    spec = {"type": "object", "properties": {"args": with_rule(array(prim("string"), 8), rule)}}
    refused = emu.post(CRDS, crd(root(spec)))
    assert refused.status == 422
    assert refused.body["reason"] == "Invalid"
    field = f"{SPEC}.properties[args].x-kubernetes-validations[0].rule"
    message = f"Forbidden: estimated rule cost exceeds budget by factor of 2.0x {HINT}"
    assert refused.body["message"] == (
        'CustomResourceDefinition.apiextensions.k8s.io "gadgets.budget.example.com" is invalid: '
        f"{field}: {message}"
    )
    assert refused.body["details"]["causes"] == [
        {"reason": "FieldValueForbidden", "message": message, "field": field}
    ]
    assert emu.get(f"{CRDS}/gadgets.budget.example.com").status == 404

    # bounded, it installs; an update that makes it expensive again is refused
    bounded = copy.deepcopy(spec)
    bounded["properties"]["args"]["items"]["maxLength"] = 128
    created = emu.post(CRDS, crd(root(bounded))).ok()
    try:
        created["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = root(spec)
        updated = emu.put(f"{CRDS}/gadgets.budget.example.com", created)
        assert updated.status == 422
        assert updated.body["details"]["causes"][0]["field"] == field
    finally:
        emu.delete(f"{CRDS}/gadgets.budget.example.com").ok()
