"""An InferenceService as the operator sees it: defaulted, validated, with the facts builders need.

The API server defaults and validates a spec against the CRD before the operator ever sees it;
the operator does it again, with the same schema and the same CEL rules, because ``render`` runs
without a server, a cluster may still have an older CRD installed, and some checks (the engine's
own ``__post_init__`` rules, and what this engine build refuses at start-up: ``runnable``) are
beyond the schema. A failure is an ``InvalidSpec`` naming every problem, never an exception that
makes kopf retry.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from typing import Any

from ketch.engine.config import EngineConfig
from ketch.engine.serving.config import ServerConfig
from ketch.operator import runnable
from ketch.operator.api_names import ROLE_NAMES
from ketch.operator.crd import engine_fields
from ketch.operator.crd.document import crd_document
from ketch.operator.crd.spec import PEER_KEY_REQUIRED
from ketch.operator.pod_layout import API_KEY_PATH, MODEL_MOUNT, PEER_KEY_PATH


class InvalidSpec(ValueError):
    """The InferenceService cannot be deployed as written; ``problems`` says why, field by field."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fills in schema defaults as the API server does (absent properties only, recursively)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in set(out) - set(schema.get("properties", {})):
                out[name] = apply_defaults(extra, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


@functools.cache
def _schema() -> dict[str, Any]:
    return crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@functools.cache
def _json_schema_validator() -> Any:
    import jsonschema

    return jsonschema.Draft7Validator(_to_json_schema(_schema()))


def _to_json_schema(schema: Any) -> Any:
    """OpenAPI v3 (Kubernetes structural) -> JSON Schema: drop the x-kubernetes-* extensions."""
    if isinstance(schema, dict):
        out = {k: _to_json_schema(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if schema.get("type") == "object" and "properties" in schema:
            out.setdefault("additionalProperties", False)
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            out.pop("additionalProperties", None)
        if "properties" in out:
            out["properties"] = {k: _to_json_schema(v) for k, v in schema["properties"].items()}
        return out
    if isinstance(schema, list):
        return [_to_json_schema(v) for v in schema]
    return schema


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _cel_problems(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Evaluates the CRD's CEL rules on ``value`` (already defaulted), depth first."""
    problems: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        if not _evaluate_rule(rule["rule"], value):
            where = path + rule.get("fieldPath", "")
            problems.append(f"{where}: {rule['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                problems += _cel_problems(sub, value[name], f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += _cel_problems(schema["items"], item, f"{path}[{i}]")
    return problems


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _evaluate_rule(rule: str, value: Any) -> bool:
    import celpy

    try:
        result = _program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except Exception:  # an evaluation error is a failed rule, as in the API server
        return False
    return bool(result) if not isinstance(result, Exception) else False


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

    def engine_settings(self, role: str) -> dict[str, Any]:
        """The role's config file for 'ketch serve': every field the spec sets, plus the role,
        and on a CPU role with ``resources.cpu`` the threads of each worker process
        (``runnable.threads_per_rank``) unless ``engine.numThreads`` sets them."""
        values = engine_fields.engine_settings(self.spec)
        values["model"] = model_path(self.spec["model"]["uri"])
        values["served_model_name"] = self.spec["model"].get("name") or default_served_name(
            self.spec["model"]["uri"], self.name
        )
        values["role"] = role
        if role == "prefill":  # speculation happens in decode steps, which prefill pods skip
            values.pop("speculative_config", None)
        resources = self.role(role)["resources"]
        if resources["gpus"] == 0 and resources.get("cpu") and "num_threads" not in values:
            tp = values.get("tensor_parallel_size", 1)
            values["num_threads"] = runnable.threads_per_rank(resources["cpu"], tp)
        if role == "decode":  # pairing headers may name only these prefill pods' pd-comm ports
            peers = f"{self.name}-prefill-peers.{self.namespace}.svc"
            values["pd_prefill_peers"] = f"{peers}:{self.spec['ports']['pdComm']}"
        if "apiKeySecretRef" in self.spec.get("auth", {}):
            values["api_key_file"] = API_KEY_PATH
        if role != "mixed" and "peerKeySecretRef" in self.spec.get("auth", {}):
            values["peer_key_file"] = PEER_KEY_PATH  # read by the engine and its cache manager
        return dict(sorted(values.items()))


def model_path(uri: str) -> str:
    """Where the engine finds the weights inside the pod."""
    if uri == "tiny":
        return "tiny"
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return rest
    if scheme == "pvc":
        _claim, _, sub = rest.partition("/")
        return f"{MODEL_MOUNT}/{sub}".rstrip("/") if sub else MODEL_MOUNT
    return MODEL_MOUNT  # hf:// and s3:// are fetched there by the model-fetch init container


def default_served_name(uri: str, service_name: str) -> str:
    if uri == "tiny":
        return "tiny"
    tail = uri.rstrip("/").rsplit("/", 1)[-1]
    return tail or service_name


def extra_args_problems(args: list[str]) -> list[str]:
    """``engine.extraArgs`` entries that would set a flag the operator owns: as written, as
    ``--flag=value``, or abbreviated (``--pd-prefill-pe`` for ``--pd-prefill-peers``: argparse
    takes any unambiguous prefix unless the parser says ``allow_abbrev=False``, which an older
    engine image may not). The CRD's CEL rule is a cheaper subset of this check."""
    problems = []
    owned = engine_fields.owned_flags()
    for i, arg in enumerate(args):
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or name == "--":
            continue
        hits = [flag for flag in owned if flag.startswith(name)]
        if not hits:
            continue
        how = "sets" if name in hits else "abbreviates"
        hits = [name] if name in hits else hits
        sources = sorted({s for s in map(engine_fields.flag_source, hits) if s})
        owner = f"the operator sets from {' / '.join(sources)}: set that instead"
        problems.append(
            f"spec.engine.extraArgs[{i}]: {arg!r} {how} {' or '.join(hits)}, which "
            + (owner if sources else "only the operator may set")
        )
    return problems


def engine_problem(exc: ValueError) -> str:
    """The engine's own refusal of a spec's settings (``EngineConfig``/``ServerConfig``), named
    by the spec field where the message says which: ``speculative_config.<key> ...`` is
    ``spec.engine.speculativeConfig.<camelKey>``; the rest are ``spec.engine``'s."""
    message = str(exc)
    match = re.match(r"speculative_config(?:\.([a-z_]+))?", message)
    if match is None:
        return f"spec.engine: {message}"
    key = f".{engine_fields.camel(match.group(1))}" if match.group(1) else ""
    return f"spec.engine.speculativeConfig{key}: {message}"


def draft_model_problems(spec: dict[str, Any]) -> list[str]:
    """A draft model under /models exists only where that is a pvc:// model's claim (mounted
    whole); with any other model.uri, /models is the fetched model or not mounted at all."""
    draft = (spec["engine"].get("speculativeConfig") or {}).get("model")
    inside = isinstance(draft, str) and (
        draft.rstrip("/") == MODEL_MOUNT or draft.startswith(f"{MODEL_MOUNT}/")
    )
    uri = spec["model"]["uri"]
    if not inside or uri.startswith("pvc://"):
        return []
    if uri.split("://")[0] in ("hf", "s3"):
        there = f"{MODEL_MOUNT} holds only the model fetched from {uri}"
    else:
        there = f"nothing is mounted at {MODEL_MOUNT} with model.uri {uri}"
    return [
        f"spec.engine.speculativeConfig.model: {draft}: {there}; a claim is mounted there "
        "only for a pvc:// model.uri. Put the draft model in engine.image, or both models on "
        "one claim"
    ]


def parse(body: dict[str, Any], *, cel: bool = True) -> ServiceSpec:
    """Validates and defaults an InferenceService object; raises ``InvalidSpec``.

    ``cel=False`` skips the CRD's CEL rules: the operator passes it for objects it read from the
    API server, which enforced those same rules (the CRD is generated from this module's
    schema) — they cost ~20 ms per spec in a Python CEL interpreter, the operator's largest cost
    in a burst. Structural checks, the engine's own rules and the peer-key rule (fail closed)
    always run.
    """
    metadata = body.get("metadata") or {}
    name = metadata.get("name") or ""
    raw = body.get("spec")
    if not isinstance(raw, dict):
        raise InvalidSpec(["spec: Required value: an InferenceService needs a spec"])
    schema = _schema()
    spec = apply_defaults(schema["properties"]["spec"], raw)
    problems = [
        f"{_path(e.absolute_path)}: {e.message}"
        for e in sorted(
            _json_schema_validator().iter_errors({"spec": spec}), key=lambda e: list(e.path)
        )
    ]
    if problems:  # CEL rules assume a structurally valid object
        raise InvalidSpec(problems)
    if cel:
        problems += _cel_problems(schema["properties"]["spec"], spec, "spec")
        for rule in schema.get("x-kubernetes-validations", []):
            if not _evaluate_rule(rule["rule"], {"metadata": {"name": name}}):
                problems.append(f"metadata.name: {rule['message']}")
    problems += extra_args_problems(spec["engine"].get("extraArgs", []))
    problems += draft_model_problems(spec)
    # Fail closed whatever the API server enforced (an older CRD, no CEL): a prefill/decode pod
    # without a peer key would take pd-comm and KV transfers from anyone who reaches it.
    disaggregated = any(r in spec["roles"] for r in ("prefill", "decode"))
    if disaggregated and "peerKeySecretRef" not in spec.get("auth", {}):
        problem = f"spec.auth: {PEER_KEY_REQUIRED}"
        if problem not in problems:
            problems.append(problem)
    if problems:
        raise InvalidSpec(problems)
    service = ServiceSpec(
        name=name,
        namespace=metadata.get("namespace") or "default",
        uid=metadata.get("uid") or "",
        generation=int(metadata.get("generation") or 0),
        spec=spec,
    )
    for role in service.roles:  # the engine's own rules, beyond the schema
        values = service.engine_settings(role)
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        try:
            engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_names})
            ServerConfig(**{k: v for k, v in values.items() if k not in engine_names})
        except ValueError as exc:
            raise InvalidSpec([engine_problem(exc)]) from exc
        res, shm = service.role(role)["resources"], spec["engine"]["shmSize"]
        found = runnable.problems(
            engine,
            role=role,
            gpus=res["gpus"],
            shm_size=shm,
            cpu=res.get("cpu"),
            memory=res.get("memory"),
        )
        for problem in found:
            if problem not in problems:  # spec.engine fields apply to every role
                problems.append(problem)
    if problems:  # what the engine would refuse at start-up: pods that would crash-loop
        raise InvalidSpec(problems)
    return service
