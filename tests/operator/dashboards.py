"""The Grafana dashboards of charts/ketch/dashboards, read as a test needs them: their panels'
PromQL with the template variables filled in, and the metric names an expression uses."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "charts" / "ketch" / "dashboards"
EXPECTED = {"engine.json", "router.json", "cache-manager.json", "operator.json"}

# The EPP's series on the router's /metrics (ketch.engine.router.epp.EppMetrics): a router has
# them only when started with --epp-port, which the operator does for an InferenceService with
# a gateway section (test_dashboards_real's has one).
EPP_SERIES = frozenset(
    {"ketch:epp_requests_total", "ketch:epp_decision_seconds_bucket", "ketch:epp_streams"}
)

# What Grafana puts in for its built-in interval variables when a test evaluates a query.
RATE_INTERVAL = "1m"


@dataclass(frozen=True)
class Target:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}: {self.expr}"


def load() -> dict[str, dict[str, Any]]:
    """file name -> dashboard JSON."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those nested in collapsed rows included; rows themselves excluded."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def targets(boards: dict[str, dict[str, Any]]) -> list[Target]:
    return [
        Target(name, panel["title"], target["refId"], target["expr"])
        for name, board in boards.items()
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable syntaxes ($x, ${x}, [[x]]) replaced by values, and its built-in
    intervals by RATE_INTERVAL; an unknown variable is an error, not left in."""
    values = {"__rate_interval": RATE_INTERVAL, "__interval": RATE_INTERVAL, **values}

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            raise KeyError(f"no value for variable {name!r} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", one, expr)


# --------------------------------------------------------------------------- metric names

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "atan2",
}  # fmt: skip
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, by a small tokenizer: strings, label
    matchers ({...}), ranges ([...]), grouping lists and function names are not names.
    (The real-Prometheus test asks Prometheus' own parser instead: /api/v1/parse_query.)"""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    text = re.sub(r"(?<![a-zA-Z0-9_:])[0-9.][0-9a-zA-Z_.+-]*", " ", text)  # numbers
    names = set()
    for match in _NAME.finditer(text):
        word, rest = match.group(0), text[match.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function, an aggregation, a keyword
        names.add(word)
    return names


def ast_names(node: Any) -> set[str]:
    """The metric names in Prometheus' own parse tree (/api/v1/parse_query's answer)."""
    names: set[str] = set()
    if isinstance(node, dict):
        if node.get("type") in ("vectorSelector", "matrixSelector"):
            name = node.get("name") or next(
                (m["value"] for m in node.get("matchers", []) if m.get("name") == "__name__"),
                "",
            )
            if name:
                names.add(name)
        for value in node.values():
            names |= ast_names(value)
    elif isinstance(node, list):
        for item in node:
            names |= ast_names(item)
    return names


def variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return dashboard.get("templating", {}).get("list", [])


def label_values_query(variable: dict[str, Any]) -> tuple[str, str]:
    """A query variable's ``label_values(selector, label)`` as (selector, label)."""
    query = variable["query"]
    text = query["query"] if isinstance(query, dict) else query
    match = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", text)
    if not match:
        raise ValueError(f"variable {variable['name']}: not label_values(...): {text!r}")
    return match.group(1), match.group(2)


def apply_regex(variable: dict[str, Any], values: list[str]) -> list[str]:
    """Grafana's variable regex (/.../): keeps matching values, the first group if any."""
    regex = variable.get("regex") or ""
    if not regex:
        return values
    pattern = re.compile(regex.strip("/"))
    out = []
    for value in values:
        match = pattern.search(value)
        if match:
            out.append(match.group(1) if match.groups() else value)
    return sorted(set(out))
