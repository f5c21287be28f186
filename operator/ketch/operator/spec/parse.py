"""``parse``: an InferenceService object -> a ``ServiceSpec``, or an ``InvalidSpec`` naming every
problem. The steps, in order: defaults (``spec.defaults``), the CRD's structural schema and CEL
rules (``spec.admission``), the checks beyond the schema (``spec.checks``), then the engine's own
rules and what this engine build refuses at start-up (``EngineConfig``, ``ServerConfig``,
``runnable``) on each role's config file (``spec.engine_config``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ketch.engine.config import EngineConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator import runnable
from ketch.operator.spec.admission import (
    cel_problems,
    name_problems,
    openapi_schema,
    structural_problems,
)
from ketch.operator.spec.checks import (
    draft_model_problems,
    engine_problem,
    extra_args_problems,
    peer_key_problems,
)
from ketch.operator.spec.defaults import apply_defaults
from ketch.operator.spec.engine_config import role_settings
from ketch.operator.spec.model import ServiceSpec


class InvalidSpec(ValueError):
    """The InferenceService cannot be deployed as written; ``problems`` says why, field by field."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def parse(body: dict[str, Any], *, cel: bool = True) -> ServiceSpec:
    """Validates and defaults an InferenceService object; raises ``InvalidSpec``.

    ``cel=False`` skips the CRD's CEL rules: the operator passes it for objects it read from the
    API server, which enforced those same rules (the CRD is generated from this package's
    schema) — they cost ~20 ms per spec in a Python CEL interpreter, the operator's largest cost
    in a burst. Structural checks, the engine's own rules and the peer-key rule (fail closed)
    always run.
    """
    metadata = body.get("metadata") or {}
    name = metadata.get("name") or ""
    raw = body.get("spec")
    if not isinstance(raw, dict):
        raise InvalidSpec(["spec: Required value: an InferenceService needs a spec"])
    spec_schema = openapi_schema()["properties"]["spec"]
    spec = apply_defaults(spec_schema, raw)
    problems = structural_problems(spec)
    if problems:  # CEL rules assume a structurally valid object
        raise InvalidSpec(problems)
    if cel:
        problems += cel_problems(spec_schema, spec, "spec")
        problems += name_problems(name)
    problems += extra_args_problems(spec["engine"].get("extraArgs", []))
    problems += draft_model_problems(spec)
    problems += [p for p in peer_key_problems(spec) if p not in problems]
    if problems:
        raise InvalidSpec(problems)
    service = ServiceSpec(
        name=name,
        namespace=metadata.get("namespace") or "default",
        uid=metadata.get("uid") or "",
        generation=int(metadata.get("generation") or 0),
        spec=spec,
    )
    problems = _engine_refusals(service)
    if problems:  # what the engine would refuse at start-up: pods that would crash-loop
        raise InvalidSpec(problems)
    return service


def _engine_refusals(service: ServiceSpec) -> list[str]:
    """The engine's own rules on each role's config file (the first role whose settings
    ``EngineConfig``/``ServerConfig`` refuse raises), then what this engine build refuses at
    start-up (``runnable``), each problem once: spec.engine fields apply to every role."""
    problems: list[str] = []
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    for role in service.roles:
        values = role_settings(service, role)
        try:
            engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
            ServerConfig(**{k: v for k, v in values.items() if k not in engine_names})
        except ValueError as exc:
            raise InvalidSpec([engine_problem(exc)]) from exc
        res = service.role(role)["resources"]
        found = runnable.problems(
            engine,
            role=role,
            gpus=res["gpus"],
            shm_size=service.spec["engine"]["shmSize"],
            cpu=res.get("cpu"),
            memory=res.get("memory"),
        )
        for problem in found:
            if problem not in problems:
                problems.append(problem)
    return problems
