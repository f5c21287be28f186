"""Command-line flags generated from ``EngineConfig``'s fields (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from ketch.engine.config import EngineConfig


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per EngineConfig field, with the field's help text and default."""
    group = parser.add_argument_group("engine")
    hints = get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = _base_type(hints[f.name])
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
            type=kind,
            default=None,
            choices=choices,
            help=help_text,
            metavar=None if choices else f.name.upper(),
        )


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """Flags that were given override the dataclass defaults; unset ones keep them."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }
    values.update(overrides)
    return EngineConfig(**values)


def _base_type(hint: Any) -> type:
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint
