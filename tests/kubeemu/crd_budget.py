"""kube-apiserver's static CEL cost budget for CustomResourceDefinitions, and its refusal.

At CRD create/update the apiserver estimates every ``x-kubernetes-validations`` rule
(:mod:`kubeemu.cel_cost`) and multiplies it by the most times the rule can run per object: the
product of ``maxItems``/``maxProperties`` of the lists and maps above the rule's node (a list's
rule runs once for the list; its items' rules once per item). Where one of those is unbounded it
uses instead how many of the smallest value of the node fit in the 3 MiB request. A rule over
``StaticEstimatedCostLimit`` (1e7) is refused, and so is a schema whose rules add up to more than
``StaticEstimatedCRDCostLimit`` (1e8), naming the (up to four) rules that contributed at least 1%
of it. ``messageExpression`` costs are checked unmultiplied. On an update, a version whose
schema did not change is exempt from the per-rule limit (not from the total), so that a control
plane upgrade that re-prices rules does not lock a CRD. (``apiextensions-apiserver``
``pkg/apis/apiextensions/validation``: ``validation.go``, ``cel_validation.go``.)

Paths and messages are the apiserver's: a v1 CRD whose versions share one schema is validated as
``spec.validation.openAPIV3Schema``, else per ``spec.versions[i].schema.openAPIV3Schema``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kubeemu import cel_ast, cel_types
from kubeemu.cel_cost import estimate_rule
from kubeemu.cel_estimate import UINT64_MAX, CostNotModelled
from kubeemu.cel_runtime import CelParser

STATIC_ESTIMATED_COST_LIMIT = 10_000_000
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000
FORBIDDEN = "FieldValueForbidden"
INVALID = "FieldValueInvalid"
_HINT = (
    "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, "
    "maps, and strings are declared)"
)
_CONTRIBUTED = "contributed to estimated rule cost total exceeding cost limit for entire OpenAPIv3 "
_CONTRIBUTED += "schema"


@dataclass(frozen=True)
class RuleCost:
    """One rule (or messageExpression) as the apiserver prices it."""

    path: str  # e.g. openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule
    expression: str
    max_cost: int  # estimated cost of one evaluation
    cardinality: int  # most evaluations per object (1 for messageExpression)
    cost: int  # max_cost * cardinality: what the limits apply to

    @property
    def is_rule(self) -> bool:
        return self.path.endswith(".rule")


def _times(cost: int, cardinality: int) -> int:
    return 0 if cost == 0 else min(cost * cardinality, UINT64_MAX)


def _max_elements(schema: dict) -> int | None:
    """extractMaxElements: how many children a node can hold per occurrence; None = unbounded."""
    kind = schema.get("type")
    if kind == "object":
        if "additionalProperties" in schema:
            return max(int(schema["maxProperties"]), 0) if "maxProperties" in schema else None
        return 1
    if kind == "array":
        return max(int(schema["maxItems"]), 0) if "maxItems" in schema else None
    return 1


def schema_rule_costs(schema: dict, path: str = "openAPIV3Schema") -> list[RuleCost]:
    """Every rule's cost, in the order the apiserver reports them (children before a node's
    own rules). Raises CostNotModelled for a rule outside the estimator's subset."""
    return list(_walk(schema, path, 1, root=True))


def _walk(s: dict, path: str, cardinality: int | None, *, root: bool = False) -> Iterator[RuleCost]:
    if not isinstance(s, dict):
        return
    below = None if cardinality is None else _child_cardinality(s, cardinality)
    extra = s.get("additionalProperties")
    if isinstance(extra, dict):
        yield from _walk(extra, f"{path}.additionalProperties", below)
    for name, prop in (s.get("properties") or {}).items():
        yield from _walk(prop, f"{path}.properties[{name}]", below)
    if isinstance(s.get("items"), dict):
        yield from _walk(s["items"], f"{path}.items", below)
    rules = s.get("x-kubernetes-validations") or []
    if not rules:
        return
    decl = cel_types.schema_decl_type(s, root or bool(s.get("x-kubernetes-embedded-resource")))
    if decl is None:
        return  # the apiserver refuses the rules themselves (no CEL type)
    if cardinality is None:  # under an unbounded list or map
        cardinality = cel_types.MAX_REQUEST_SIZE_BYTES // (decl.min_size + 1)
    for i, rule in enumerate(rules):
        where = f"{path}.x-kubernetes-validations[{i}]"
        text = rule.get("rule") or ""
        cost = _estimate(text, decl, f"{where}.rule") if text.strip() else 0
        yield RuleCost(f"{where}.rule", text, cost, cardinality, _times(cost, cardinality))
        message = rule.get("messageExpression") or ""
        if message.strip():
            cost = _estimate(message, decl, f"{where}.messageExpression")
            yield RuleCost(f"{where}.messageExpression", message, cost, 1, cost)


def _child_cardinality(s: dict, cardinality: int) -> int | None:
    factor = _max_elements(s)
    return None if factor is None else min(cardinality * factor, UINT64_MAX)


def _estimate(expression: str, decl: cel_types.DeclType, where: str) -> int:
    try:
        tree = CelParser.get().parse(expression)
    except Exception as ex:  # a syntax error is the compiler's to report
        raise CostNotModelled(f"{where}: does not parse: {ex}") from ex
    try:
        return estimate_rule(cel_ast.parse(tree), decl).hi
    except (CostNotModelled, cel_ast.CelSyntaxError) as ex:
        raise CostNotModelled(f"{where}: {ex}") from ex


# --------------------------------------------------------------------------- the refusal


def cost_error_message(cost_name: str, cost: int, limit: int) -> str:
    """getCostErrorMessage."""
    factor = cost / limit
    if factor > 100.0:
        text = "more than 100x"
    elif factor < 1.5:
        text = f"{factor:f}x"  # not "1.0x" for a rule just over
    else:
        text = f"{factor:.1f}x"
    return f"{cost_name} exceeds budget by factor of {text} {_HINT}"


def _forbidden(path: str, message: str) -> dict[str, str]:
    return {"reason": FORBIDDEN, "field": path, "message": f"Forbidden: {message}"}


def budget_causes(costs: list[RuleCost], schema_path: str, *, per_rule: bool = True) -> list[dict]:
    """The apiserver's errors for one schema's rule costs (empty when within budget)."""
    causes = []
    total = 0
    expensive: list[RuleCost] = []
    for rc in costs:
        if per_rule and rc.cost > STATIC_ESTIMATED_COST_LIMIT:
            name = "estimated rule cost" if rc.is_rule else "estimated messageExpression cost"
            causes.append(
                _forbidden(rc.path, cost_error_message(name, rc.cost, STATIC_ESTIMATED_COST_LIMIT))
            )
        total = min(total + rc.cost, UINT64_MAX)
        if rc.cost >= STATIC_ESTIMATED_CRD_COST_LIMIT // 100:
            # stable sort, most expensive first, keep four (TotalCost.ObserveExpressionCost)
            expensive = sorted([*expensive, rc], key=lambda r: -r.cost)[:4]
    if total > STATIC_ESTIMATED_CRD_COST_LIMIT:
        causes += [_forbidden(rc.path, _CONTRIBUTED) for rc in expensive]
        name = "x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema"
        causes.append(
            _forbidden(
                schema_path, cost_error_message(name, total, STATIC_ESTIMATED_CRD_COST_LIMIT)
            )
        )
    return causes


def _version_schemas(crd: dict) -> dict[str, dict]:
    versions = (crd.get("spec") or {}).get("versions") or []
    return {
        v.get("name", ""): s
        for v in versions
        if isinstance(s := (v.get("schema") or {}).get("openAPIV3Schema"), dict)
    }


def _schemas(crd: dict) -> list[tuple[str, str, dict]]:
    """(version, field path, schema) as the apiserver validates them: versions that share one
    schema as spec.validation (exempted by the first version's name), else one by one."""
    versions = (crd.get("spec") or {}).get("versions") or []
    found = [
        (i, v.get("name", ""), schema)
        for i, v in enumerate(versions)
        if isinstance(schema := (v.get("schema") or {}).get("openAPIV3Schema"), dict)
    ]
    if not found:
        return []
    first = found[0][2]
    if len(found) == len(versions) and all(schema == first for _, _, schema in found):
        return [(found[0][1], "spec.validation.openAPIV3Schema", first)]
    return [(name, f"spec.versions[{i}].schema.openAPIV3Schema", s) for i, name, s in found]


def crd_cost_causes(crd: dict, old: dict | None = None) -> list[dict]:
    """Causes of a 422 for a CRD write over the CEL cost budget (empty: within budget).

    ``old`` is the stored CRD on update. A rule outside the estimator's subset is refused too,
    with the emulator's own message: an estimate it cannot make must not pass for a cheap one.
    """
    old_schemas = _version_schemas(old) if old else {}
    causes: list[dict] = []
    for version, path, schema in _schemas(crd):
        unchanged = version in old_schemas and old_schemas[version] == schema
        try:
            costs = schema_rule_costs(schema, path)
        except CostNotModelled as ex:
            message = f"Invalid value: the emulator cannot estimate the CEL cost of {ex}"
            causes.append({"reason": INVALID, "field": path, "message": message})
            continue
        causes += budget_causes(costs, path, per_rule=not unchanged)
    return causes
