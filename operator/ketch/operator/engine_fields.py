"""The engine's settings as InferenceService fields: the bridge between config dataclasses and CRD.

``EngineConfig`` and ``ServerConfig`` fields carry their help text, choices, bounds and (in
``metadata["crd"]``) their path under an InferenceService's ``spec``. ``config_fields()`` turns
them into CRD field schemas; ``engine_settings()`` walks the same table back, turning a spec into
the config file ``ketch serve --config`` reads. One table both ways: a CRD field and the flag it
sets cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, get_type_hints

from ketch.engine.cli_args import base_type, flag_name
from ketch.engine.config import EngineConfig
from ketch.engine.serving.config import ServerConfig

MEMORY_SIZE_PATTERN = r"^[0-9]*\.?[0-9]+\s*([KkMmGg]([Ii]?[Bb]?)?|[Bb])?$"
# A free-text setting (a served model name, a memory size) is far shorter; bounded so that the
# API server's CEL cost estimate does not size it from the 3 MiB request limit.
STRING_MAX_LENGTH = 256


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """A config-dataclass field as the CRD sees it: where it lives under spec, and its schema."""

    name: str  # the dataclass field (and config-file key)
    path: tuple[str, ...]  # under spec, e.g. ("engine", "maxNumSeqs")
    schema: dict[str, Any]
    kind: type  # the dataclass field's Python type (float fields arrive as JSON integers too)


@functools.cache
def config_fields() -> tuple[ConfigField, ...]:
    """Every EngineConfig/ServerConfig field that an InferenceService spec can set."""
    out: list[ConfigField] = []
    for cls in (EngineConfig, ServerConfig):
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = f.metadata.get("crd", f"engine.{camel(f.name)}")
            if path is False:
                continue
            kind = base_type(hints[f.name])
            schema: dict[str, Any] = {
                "type": {bool: "boolean", int: "integer", float: "number", str: "string"}[kind],
                "description": f"{f.metadata['help']} (ketch serve {flag_name(f.name)})",
            }
            if f.default is not None:
                schema["default"] = f.default
            if "choices" in f.metadata:
                schema["enum"] = list(f.metadata["choices"])
            elif kind is str:
                schema["maxLength"] = STRING_MAX_LENGTH
            if "minimum" in f.metadata:
                schema["minimum"] = f.metadata["minimum"]
            if f.name.endswith("port"):
                schema.update(minimum=1, maximum=65535)
            if f.name == "kv_cache_memory":
                schema["pattern"] = MEMORY_SIZE_PATTERN
            out.append(ConfigField(f.name, tuple(path.split(".")), schema, kind))
    return tuple(out)


def config_field_schemas(section: str) -> dict[str, Any]:
    return {f.path[1]: f.schema for f in config_fields() if f.path[0] == section}


def engine_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """The config-file values a (defaulted) spec sets, keyed by dataclass field name."""
    out: dict[str, Any] = {}
    for f in config_fields():
        node: Any = spec
        for key in f.path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            # JSON has one number type: the API server hands 30.0 back as 30. The engine's
            # config file must not depend on which path a value took.
            out[f.name] = float(node) if f.kind is float else node
    return out


@functools.cache
def owned_flags() -> tuple[str, ...]:
    """Every ``ketch serve`` flag the operator owns, sorted: one per EngineConfig/ServerConfig
    field (and ``--no-X`` for a boolean ``--X``) plus ``--config``.

    The operator writes all of these settings, in the role's config file (``--config``), or
    relies on their defaults (``--host`` 0.0.0.0, which the probes and Services need); a flag in
    ``engine.extraArgs`` would override the file, so none of them may appear there.
    """
    flags = {"--config"}
    for cls in (EngineConfig, ServerConfig):
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            flags.add(flag_name(f.name))
            if base_type(hints[f.name]) is bool:  # argparse.BooleanOptionalAction
                flags.add("--no-" + flag_name(f.name)[2:])
    return tuple(sorted(flags))


# Flags of settings that no engine field of the spec sets: what sets them instead.
_SET_ELSEWHERE = {
    "--model": "spec.model.uri",
    "--role": "spec.roles",
    "--api-key-file": "spec.auth.apiKeySecretRef",
    "--peer-key-file": "spec.auth.peerKeySecretRef",
}


def flag_source(flag: str) -> str | None:
    """The spec field that sets an owned flag (``--port`` -> 'spec.ports.http'), or None for
    the flags the operator sets by itself (``--config``, ``--host``, ``--pd-prefill-peers``)."""
    name = "--" + flag[len("--no-") :] if flag.startswith("--no-") else flag
    for f in config_fields():
        if flag_name(f.name) == name:
            return "spec." + ".".join(f.path)
    return _SET_ELSEWHERE.get(name)
