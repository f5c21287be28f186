"""The whole InferenceService CustomResourceDefinition document (``ketch-operator crd``): its
names (``api_names``), printer columns and root rules around the ``spec`` (``crd.spec``) and
``status`` (``crd.status``) schemas.

``crds/`` holds the output of ``ketch-operator crd``; a test fails when it is stale.
"""

from __future__ import annotations

from typing import Any

from ketch.operator.api_names import (
    CRD_NAME,
    GROUP,
    KIND,
    LONGEST_CHILD_SUFFIX,
    MAX_NAME_LENGTH,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from ketch.operator.crd.schema import NAME_MAX_LENGTH, cel_rule
from ketch.operator.crd.spec import spec_schema
from ketch.operator.crd.status import status_schema
from ketch.operator.labels import APP, LABEL_NAME, LABEL_PART_OF


def crd_document() -> dict[str, Any]:
    """The CustomResourceDefinition object, as applied to a cluster."""
    root = {
        "type": "object",
        "description": "An LLM served by Ketch engine pods: the model, the engine settings and "
        "the pods of each role.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Declared so that the root's rules see bounded names (an undeclared metadata.name
            # is an unbounded string to kube-apiserver's cost estimate before v1.37).
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": NAME_MAX_LENGTH},
                    "generateName": {"type": "string", "maxLength": NAME_MAX_LENGTH},
                },
            },
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            cel_rule(
                f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                f"metadata.name must be at most {MAX_NAME_LENGTH} characters: the operator "
                f"names children after it with suffixes of up to {LONGEST_CHILD_SUFFIX}",
            ),
            cel_rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                "metadata.name must start with a letter and hold only lowercase letters, digits "
                "and '-' (it names Services)",
            ),
        ],
    }
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {LABEL_NAME: APP, LABEL_PART_OF: APP},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["ketch", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Ready", "type": "string", "jsonPath": ready},
                        {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
                        {"name": "Replicas", "type": "string", "jsonPath": ".status.replicas"},
                        {"name": "URL", "type": "string", "jsonPath": ".status.url"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }
