"""``ServiceSpec``: a validated, defaulted InferenceService, the input of every builder.

Made by ``spec.parse.parse`` only; plain data with the facts builders ask for (roles, mode,
ports).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ketch.operator.api_names import ROLE_NAMES


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    """A validated, defaulted InferenceService: the input of every builder."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: dict[str, Any]  # defaulted spec, camelCase as in the CRD

    @property
    def roles(self) -> list[str]:
        return [r for r in ROLE_NAMES if r in self.spec["roles"]]

    @property
    def disaggregated(self) -> bool:
        return "prefill" in self.spec["roles"]

    @property
    def mode(self) -> str:
        return "disaggregated" if self.disaggregated else "mixed"

    def role(self, role: str) -> dict[str, Any]:
        return self.spec["roles"][role]

    @property
    def ports(self) -> dict[str, int]:
        return self.spec["ports"]
