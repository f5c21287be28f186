"""The Argo CD health check of InferenceServices (manifests/argocd/health.lua), run as Argo CD
runs it: a Lua 5.1 interpreter (lupa's, as gopher-lua implements 5.1) with only the base,
table, string and math libraries, the object as global ``obj``, converted from JSON as Argo CD
converts it (objects and arrays become tables, arrays 1-based; JSON null is no value at all, so
it ends an array for ``ipairs``; every number is a float, as gopher-lua has no integers).

The expected health of an object, decided from the operator's conditions in Python
(``expected``), is the second opinion the recorder (record_argocd_statuses.py) stores with
each status it recorded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lupa import lua51

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "manifests" / "argocd" / "health.lua"
DATA = ROOT / "tests" / "data" / "argocd"
STATES = ("Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown")

# What a Lua 5.1 interpreter opens beyond base/table/string/math, and what of base reaches files
# or code: removed, as Argo CD never opens or offers them.
REMOVED = (
    "os",
    "io",
    "debug",
    "package",
    "coroutine",
    "require",
    "module",
    "dofile",
    "loadfile",
    "load",
    "loadstring",
    "python",
)


def runtime() -> Any:
    lua = lua51.LuaRuntime(register_eval=False, register_builtins=False)
    g = lua.globals()
    for name in REMOVED:
        g[name] = None
    return lua


def to_lua(lua: Any, value: Any) -> Any:
    """``value`` (decoded JSON) as Argo CD hands it to Lua."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        number = float(value)  # OverflowError for an int no float64 holds (nor could Argo CD's)
        if math.isnan(number):
            raise ValueError("NaN is not JSON")
        return number
    if isinstance(value, dict):
        table = lua.table()
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys are strings, not {type(key).__name__}")
            if item is not None:
                table[key] = to_lua(lua, item)
        return table
    if isinstance(value, list):
        table = lua.table()
        for index, item in enumerate(value, start=1):
            if item is not None:
                table[index] = to_lua(lua, item)
        return table
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def health(obj: Any, script: str | None = None) -> tuple[str, str]:
    """(status, message) of ``obj`` by the Lua script, run in a fresh sandbox; a Lua error
    raises (lupa.LuaError), as it would fail in Argo CD."""
    lua = runtime()
    lua.globals().obj = to_lua(lua, obj)
    result = lua.execute(script if script is not None else SCRIPT.read_text())
    status, message = result["status"], result["message"]
    if status not in STATES:
        raise AssertionError(f"not an Argo CD health status: {status!r}")
    if not isinstance(message, str):
        raise AssertionError(f"message is {type(message).__name__}, not a string")
    return status, message


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


def expected(obj: dict[str, Any]) -> str:
    """The health a well-formed InferenceService (as the operator writes it) should have:
    Progressing until the operator has observed the generation; Degraded while Degraded is
    True; Healthy once Ready is True and every role has its desired pods ready (Suspended when
    every engine role wants none); Progressing otherwise."""
    status = obj.get("status") or {}
    if status.get("observedGeneration", 0) < obj["metadata"]["generation"]:
        return "Progressing"
    if _condition(status, "Degraded").get("status") == "True":
        return "Degraded"
    if _condition(status, "Ready").get("status") != "True":
        return "Progressing"
    roles = status.get("roles") or {}
    if any(r.get("ready", 0) < r.get("desired", 0) for r in roles.values()):
        return "Progressing"
    engine = {k: r for k, r in roles.items() if k != "router" or status["mode"] != "disaggregated"}
    if engine and all(r.get("desired") == 0 for r in engine.values()):
        return "Suspended"
    return "Healthy"
