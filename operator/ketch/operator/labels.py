"""The label and annotation keys the operator puts on its children, and the values it owns.

A leaf: the builders, the watches (``handlers``, ``gateway_watch``), the coordinated
autoscaler and the tests read them here.
"""

from __future__ import annotations

APP = "ketch"  # app.kubernetes.io/name and app.kubernetes.io/part-of of every child
MANAGER = "ketch-operator"  # app.kubernetes.io/managed-by of every child

LABEL_NAME = "app.kubernetes.io/name"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "serving.ketch.dev/role"

# On the pod template: the hash of the pod's config file, so a config change rolls the pods.
ANNOTATION_CONFIG_HASH = "serving.ketch.dev/config-hash"
