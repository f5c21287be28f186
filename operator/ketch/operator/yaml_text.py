"""YAML as the operator writes it: the engine's and router's config files, ``ketch-operator
render``, ``crd`` and ``adapter-rules``. A leaf (PyYAML only)."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # libyaml's emitter when present
    """Plain YAML: no anchors/aliases even where builders share a sub-object."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(value: Any) -> str:
    return yaml.dump(value, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
