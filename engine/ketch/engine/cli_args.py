"""Command-line flags generated from config dataclasses (one source of truth).

``EngineConfig`` and ``ServerConfig`` fields carry their help text in ``metadata``; the flags,
the config-file keys and (later) the CRD's fields all come from those definitions. A config file
(JSON or YAML, keys as field names with ``_`` or ``-``) sets values; flags given on the command
line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from ketch.engine.config import EngineConfig

ConfigT = TypeVar("ConfigT")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Adds one flag per field of dataclass ``cls``, with the field's help text and default."""
    group = parser.add_argument_group(title)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        kind = base_type(hints[f.name])
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            group.add_argument(
                flag_name(f.name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
            continue
        choices = f.metadata.get("choices")
        group.add_argument(
            flag_name(f.name),
            type=_flag_parser(f.metadata["parse"]) if "parse" in f.metadata else kind,
            default=None,
            choices=choices,
            help=help_text,
            metavar=None if choices else f.metadata.get("metavar", f.name.upper()),
        )


def _flag_parser(parse):
    """A field's own parser as an argparse ``type``: its ValueError's text is the error shown
    (argparse would say only "invalid parse value")."""

    def flag_value(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return flag_value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, EngineConfig, "engine")


def config_from_args(
    cls: type[ConfigT], args: argparse.Namespace, file_values: dict[str, Any] | None = None
) -> ConfigT:
    """File values first, then every flag that was given; unset ones keep the defaults."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {k: v for k, v in (file_values or {}).items() if k in names}
    values.update(
        {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    )
    return cls(**values)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    config = config_from_args(EngineConfig, args)
    return dataclasses.replace(config, **overrides) if overrides else config


def read_config_file(path: str, *classes: type) -> dict[str, Any]:
    """Reads a JSON/YAML mapping of field names to values; unknown keys are an error."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path} does not exist")
    return parse_config_text(file.read_text(), path, *classes)


def parse_config_text(text: str, path: str, *classes: type) -> dict[str, Any]:
    """What ``read_config_file`` makes of ``text`` read from ``path`` (its suffix picks YAML or
    JSON; errors name it), without reading a file: e.g. a ConfigMap's key mounted at ``path``."""
    try:
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json and yaml raise different types; both mean "bad file"
        raise ValueError(f"config file {path} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of setting names to values")
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s) {unknown}")
    return values


def base_type(hint: Any) -> type:
    """``int | None`` -> ``int``: the type a flag (or CRD field) parses to."""
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint
