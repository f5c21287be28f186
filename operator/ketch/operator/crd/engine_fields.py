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
# http(s)://host[:port][/path] or host:port (``ketch.engine.tracing.check_endpoint`` decides;
# this refuses the obvious mistakes at admission).
OTLP_ENDPOINT_PATTERN = (
    r"^(https?://(\[[0-9a-fA-F:.]+\]|[^\s/?#@:\[\]]+)(:[0-9]{1,5})?(/[^\s?#]*)?"
    r"|(\[[0-9a-fA-F:.]+\]|[^\s/?#@:\[\]]+):[0-9]{1,5})$"
)
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
            schema = _field_schema(f, kind, f"(ketch serve {flag_name(f.name)})")
            if f.name.endswith("port"):
                schema.update(minimum=1, maximum=65535)
            if f.name == "kv_cache_memory":
                schema["pattern"] = MEMORY_SIZE_PATTERN
            if f.name == "otlp_traces_endpoint":
                schema["pattern"] = OTLP_ENDPOINT_PATTERN
            out.append(ConfigField(f.name, tuple(path.split(".")), schema, kind))
    return tuple(out)


_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _field_schema(f: dataclasses.Field, kind: type, suffix: str = "") -> dict[str, Any]:
    """A config-dataclass field's schema: its type, ``metadata["help"]`` (+ ``suffix``) as the
    description, and its default, ``choices``, ``minimum`` and ``maximum``. A field whose type is
    itself a dataclass (``speculative_config``) is an object of that dataclass's fields, by
    camelCase name, the ones without a default required; its value in the config file is the
    mapping of their snake_case names (``_to_config``)."""
    description = f"{f.metadata['help']} {suffix}".strip()
    if dataclasses.is_dataclass(kind):
        hints = get_type_hints(kind)
        props = {
            camel(sub.name): _field_schema(sub, base_type(hints[sub.name]))
            for sub in dataclasses.fields(kind)
        }
        required = [
            camel(sub.name)
            for sub in dataclasses.fields(kind)
            if sub.default is dataclasses.MISSING and sub.default_factory is dataclasses.MISSING
        ]
        schema: dict[str, Any] = {
            "type": "object",
            "description": description,
            "properties": props,
        }
        if required:
            schema["required"] = required
        return schema
    schema = {"type": _TYPES[kind], "description": description}
    if f.default is not None and f.default is not dataclasses.MISSING:
        schema["default"] = f.default
    if "choices" in f.metadata:
        schema["enum"] = list(f.metadata["choices"])
    elif kind is str:
        schema["maxLength"] = STRING_MAX_LENGTH
    for bound in ("minimum", "maximum"):
        if bound in f.metadata:
            schema[bound] = f.metadata[bound]
    return schema


def _to_config(value: Any, kind: type) -> Any:
    """A spec value as the config file holds it: float fields as floats (JSON has one number
    type: the API server hands 30.0 back as 30, and the engine's config file must not depend on
    which path a value took), a dataclass-typed field's object with snake_case keys."""
    if dataclasses.is_dataclass(kind) and isinstance(value, dict):
        hints = get_type_hints(kind)
        return {
            sub.name: _to_config(value[camel(sub.name)], base_type(hints[sub.name]))
            for sub in dataclasses.fields(kind)
            if value.get(camel(sub.name)) is not None
        }
    return float(value) if kind is float else value


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
            out[f.name] = _to_config(node, f.kind)
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
