"""What every child object of an InferenceService shares: labels, selectors, owner metadata,
and the YAML they are written as (config files and ``ketch-operator render``)."""

from __future__ import annotations

from typing import Any

import yaml

from ketch.operator import crd
from ketch.operator.spec import ServiceSpec

MANAGER = "ketch-operator"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "serving.ketch.dev/role"
ANNOTATION_CONFIG_HASH = "serving.ketch.dev/config-hash"

Obj = dict[str, Any]


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # libyaml's emitter when present
    """Plain YAML: no anchors/aliases even where builders share a sub-object."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(value: Any) -> str:
    return yaml.dump(value, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def component(role: str) -> str:
    return "router" if role == "router" else f"engine-{role}"


def labels(svc: ServiceSpec, role: str) -> dict[str, str]:
    out = selector(svc, role)
    out.update(
        {
            "app.kubernetes.io/part-of": "ketch",
            LABEL_MANAGED_BY: MANAGER,
            LABEL_ROLE: role,
        }
    )
    return out


def selector(svc: ServiceSpec, role: str) -> dict[str, str]:
    """Labels that pick one role's pods; never changes for a given InferenceService and role."""
    return {
        "app.kubernetes.io/name": "ketch",
        LABEL_INSTANCE: svc.name,
        LABEL_COMPONENT: component(role),
    }


def instance_labels(svc: ServiceSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ketch",
        LABEL_INSTANCE: svc.name,
        "app.kubernetes.io/part-of": "ketch",
        LABEL_MANAGED_BY: MANAGER,
    }


def metadata(svc: ServiceSpec, name: str, lbls: dict[str, str]) -> Obj:
    return {
        "name": name,
        "namespace": svc.namespace,
        "labels": lbls,
        "ownerReferences": [
            {
                "apiVersion": crd.API_VERSION,
                "kind": crd.KIND,
                "name": svc.name,
                "uid": svc.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
