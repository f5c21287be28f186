"""The InferenceService's API names (group, version, kind, plural, ...), the roles of its pods,
and the longest name its children leave it.

A leaf: the CRD document (``crd.document``), the owner references of every child
(``objects``), the API client (``kube``), the kopf handlers and the tests read them here.
"""

from __future__ import annotations

GROUP = "serving.ketch.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["kisvc"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

# The engine pods' roles, in the order the operator builds them: ``mixed`` alone, or
# ``prefill`` and ``decode`` together (spec.roles).
ROLE_NAMES = ("mixed", "prefill", "decode")

# Longest suffix the operator adds to the name: "-prefill-peers" (Service names are DNS-1035
# labels of at most 63 characters).
LONGEST_CHILD_SUFFIX = len("-prefill-peers")
MAX_NAME_LENGTH = 63 - LONGEST_CHILD_SUFFIX
