"""Checks beyond the CRD's schema: ``engine.extraArgs`` setting a flag the operator owns, a draft
model where no claim is mounted, a disaggregated spec without a peer key (fail closed, whatever
the API server enforced), and the spec field an engine refusal names.
"""

from __future__ import annotations

import re
from typing import Any

from ketch.operator.crd import engine_fields
from ketch.operator.crd.spec import PEER_KEY_REQUIRED
from ketch.operator.pod_layout import MODEL_MOUNT


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


def peer_key_problems(spec: dict[str, Any]) -> list[str]:
    """Fail closed whatever the API server enforced (an older CRD, no CEL): a prefill/decode pod
    without a peer key would take pd-comm and KV transfers from anyone who reaches it."""
    disaggregated = any(r in spec["roles"] for r in ("prefill", "decode"))
    if disaggregated and "peerKeySecretRef" not in spec.get("auth", {}):
        return [f"spec.auth: {PEER_KEY_REQUIRED}"]
    return []
