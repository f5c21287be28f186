"""What every child object of an InferenceService shares: labels, selectors and owner metadata
(the label keys are ``labels``'s, the owner's API names ``api_names``'s)."""

from __future__ import annotations

from typing import Any

from ketch.operator import api_names
from ketch.operator.labels import (
    APP,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_ROLE,
    MANAGER,
)
from ketch.operator.spec.model import ServiceSpec

Obj = dict[str, Any]


def component(role: str) -> str:
    return "router" if role == "router" else f"engine-{role}"


def labels(svc: ServiceSpec, role: str) -> dict[str, str]:
    out = selector(svc, role)
    out.update(
        {
            LABEL_PART_OF: APP,
            LABEL_MANAGED_BY: MANAGER,
            LABEL_ROLE: role,
        }
    )
    return out


def selector(svc: ServiceSpec, role: str) -> dict[str, str]:
    """Labels that pick one role's pods; never changes for a given InferenceService and role."""
    return {
        LABEL_NAME: APP,
        LABEL_INSTANCE: svc.name,
        LABEL_COMPONENT: component(role),
    }


def instance_labels(svc: ServiceSpec) -> dict[str, str]:
    return {
        LABEL_NAME: APP,
        LABEL_INSTANCE: svc.name,
        LABEL_PART_OF: APP,
        LABEL_MANAGED_BY: MANAGER,
    }


def metadata(svc: ServiceSpec, name: str, lbls: dict[str, str]) -> Obj:
    return {
        "name": name,
        "namespace": svc.namespace,
        "labels": lbls,
        "ownerReferences": [
            {
                "apiVersion": api_names.API_VERSION,
                "kind": api_names.KIND,
                "name": svc.name,
                "uid": svc.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
