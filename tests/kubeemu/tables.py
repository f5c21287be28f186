"""Server-side printing (`meta.k8s.io/v1 Table`) so `kubectl get` shows the usual columns."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from kubeemu.kinds import ResourceType


def human_age(stamp: str | None, now: datetime | None = None) -> str:
    """k8s.io/apimachinery's HumanDuration of the time since `stamp`."""
    if not stamp:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return "<unknown>"
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    seconds = int(((now or datetime.now(UTC)) - then).total_seconds())
    if seconds < -1:
        return "<invalid>"
    seconds = max(seconds, 0)
    minutes, hours = seconds // 60, seconds // 3600
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    return f"{hours // 24 // 365}y{(hours // 24) % 365}d"


_JSONPATH_TOKEN = re.compile(
    r"\.([A-Za-z0-9_\-]+)"
    r"|\[(\d+)\]"
    r"|\[\*\]"
    r"|\[\?\(@\.([A-Za-z0-9_.\-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]"
)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """The subset of JSONPath that CRD printer columns use."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    path = path.lstrip("$")
    values = [obj]
    pos = 0
    while pos < len(path):
        m = _JSONPATH_TOKEN.match(path, pos)
        if not m:
            return []
        pos = m.end()
        out: list[Any] = []
        for v in values:
            if m.group(1) is not None:
                if isinstance(v, dict) and m.group(1) in v:
                    out.append(v[m.group(1)])
            elif m.group(2) is not None:
                if isinstance(v, list) and int(m.group(2)) < len(v):
                    out.append(v[int(m.group(2))])
            elif m.group(3) is not None:
                if isinstance(v, list):
                    for item in v:
                        cur: Any = item
                        for part in m.group(3).split("."):
                            cur = cur.get(part) if isinstance(cur, dict) else None
                        if cur is not None and str(cur) == m.group(4):
                            out.append(item)
            elif isinstance(v, list):
                out.extend(v)
        values = out
    return values


def _cell(values: list[Any], col_type: str) -> Any:
    if not values:
        return None
    if col_type == "date":
        return human_age(values[0] if isinstance(values[0], str) else None)
    if len(values) == 1:
        v = values[0]
        if col_type == "string" and not isinstance(v, str):
            import json

            return (
                json.dumps(v)
                if isinstance(v, dict | list)
                else str(v).lower()
                if isinstance(v, bool)
                else str(v)
            )
        return v
    return ",".join(str(v) for v in values)


def _col(name: str, ctype: str = "string", fmt: str = "", priority: int = 0) -> dict[str, Any]:
    return {"name": name, "type": ctype, "format": fmt, "description": "", "priority": priority}


def _pod_cells(obj: dict[str, Any]) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    total = len(spec.get("containers") or [])
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount", 0)) for c in statuses)
    reason = status.get("phase", "Pending")
    for c in statuses:
        waiting = (c.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            reason = waiting["reason"]
    reason = _init_reason(spec, status) or reason
    if obj["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    return [f"{ready}/{total}", reason, restarts]


def _init_reason(spec: dict[str, Any], status: dict[str, Any]) -> str | None:
    """kubectl's STATUS while init containers have not all completed (Init:Error, Init:0/1)."""
    inits = status.get("initContainerStatuses") or []
    for i, c in enumerate(inits):
        state = c.get("state") or {}
        done = state.get("terminated") or {}
        if done and done.get("exitCode") == 0:
            continue
        if done:
            return f"Init:{done.get('reason') or 'ExitCode:' + str(done.get('exitCode'))}"
        waiting = state.get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] != "PodInitializing":
            return f"Init:{waiting['reason']}"
        return f"Init:{i}/{len(spec.get('initContainers') or inits)}"
    return None


def _replicaset_cells(obj: dict[str, Any]) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    return [spec.get("replicas", 1), status.get("replicas", 0), status.get("readyReplicas", 0)]


def _deployment_cells(obj: dict[str, Any]) -> list[Any]:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    tmpl = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    sel = (spec.get("selector") or {}).get("matchLabels") or {}
    return [
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        status.get("updatedReplicas", 0),
        status.get("availableReplicas", 0),
        ",".join(c.get("name", "") for c in tmpl),
        ",".join(c.get("image", "") for c in tmpl),
        ",".join(f"{k}={v}" for k, v in sorted(sel.items())),
    ]


def _service_cells(obj: dict[str, Any]) -> list[Any]:
    spec = obj.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    sel = spec.get("selector") or {}
    return [
        spec.get("type", "ClusterIP"),
        spec.get("clusterIP", "<none>"),
        "<none>",
        ports or "<none>",
        ",".join(f"{k}={v}" for k, v in sorted(sel.items())) or "<none>",
    ]


def _event_cells(obj: dict[str, Any]) -> list[Any]:
    ref = obj.get("involvedObject") or obj.get("regarding") or {}
    last = (
        obj.get("lastTimestamp") or obj.get("eventTime") or obj["metadata"].get("creationTimestamp")
    )
    return [
        human_age(last),
        obj.get("type", ""),
        obj.get("reason", ""),
        f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}",
        obj.get("message") or obj.get("note", ""),
    ]


_BUILTIN_COLUMNS: dict[tuple[str, str], tuple[list[dict[str, Any]], Any]] = {
    ("", "pods"): (
        [_col("Ready"), _col("Status"), _col("Restarts", "integer")],
        _pod_cells,
    ),
    ("apps", "deployments"): (
        [
            _col("Ready"),
            _col("Up-to-date", "integer"),
            _col("Available", "integer"),
            _col("Containers", priority=1),
            _col("Images", priority=1),
            _col("Selector", priority=1),
        ],
        _deployment_cells,
    ),
    ("apps", "replicasets"): (
        [_col("Desired", "integer"), _col("Current", "integer"), _col("Ready", "integer")],
        _replicaset_cells,
    ),
    ("", "services"): (
        [
            _col("Type"),
            _col("Cluster-IP"),
            _col("External-IP"),
            _col("Port(s)"),
            _col("Selector", priority=1),
        ],
        _service_cells,
    ),
    ("", "configmaps"): (
        [_col("Data", "integer")],
        lambda o: [len(o.get("data") or {}) + len(o.get("binaryData") or {})],
    ),
    ("", "secrets"): (
        [_col("Type"), _col("Data", "integer")],
        lambda o: [o.get("type", "Opaque"), len(o.get("data") or {})],
    ),
    ("", "namespaces"): ([_col("Status")], lambda o: [(o.get("status") or {}).get("phase", "")]),
}
_EVENT_COLUMNS = [_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"), _col("Message")]


def to_table(
    rt: ResourceType,
    objects: list[dict[str, Any]],
    *,
    resource_version: str,
    include_object: str = "Metadata",
    cont: str | None = None,
) -> dict[str, Any]:
    name_col = _col("Name", fmt="name")
    name_col["description"] = "Name must be unique within a namespace."
    age_col = _col("Age", "date")
    builtin = _BUILTIN_COLUMNS.get(rt.key)
    is_event = rt.kind == "Event" and not rt.is_crd
    if is_event:
        columns = [*_EVENT_COLUMNS, {**name_col, "priority": 1}]
    elif rt.is_crd and rt.printer_columns:
        columns = [name_col] + [
            _col(
                c.get("name", ""),
                c.get("type", "string"),
                c.get("format", ""),
                int(c.get("priority", 0)),
            )
            for c in rt.printer_columns
        ]
    elif builtin is not None:
        columns = [name_col, *builtin[0], age_col]
    else:
        columns = [name_col, age_col]
    rows = []
    for obj in objects:
        meta = obj["metadata"]
        if is_event:
            cells = [*_event_cells(obj), meta["name"]]
        elif rt.is_crd and rt.printer_columns:
            cells = [meta["name"]] + [
                _cell(jsonpath(obj, c.get("jsonPath", "")), c.get("type", "string"))
                for c in rt.printer_columns
            ]
        elif builtin is not None:
            cells = [meta["name"], *builtin[1](obj), human_age(meta.get("creationTimestamp"))]
        else:
            cells = [meta["name"], human_age(meta.get("creationTimestamp"))]
        row: dict[str, Any] = {"cells": cells}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": meta,
            }
        rows.append(row)
    out_meta: dict[str, Any] = {"resourceVersion": resource_version}
    if cont:
        out_meta["continue"] = cont
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": out_meta,
        "columnDefinitions": columns,
        "rows": rows,
    }
