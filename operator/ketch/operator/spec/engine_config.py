"""A role's config file for ``ketch serve --config``, rendered from a ``ServiceSpec``.

The engine fields come from the spec through ``crd.engine_fields`` (the table the CRD's engine
fields are generated from); this module adds what the operator decides itself: the model path
and served name, the role, the peers a decode pod pairs with, the key files, and the threads of
a CPU worker process.
"""

from __future__ import annotations

from typing import Any

from ketch.operator import runnable
from ketch.operator.crd import engine_fields
from ketch.operator.pod_layout import API_KEY_PATH, PEER_KEY_PATH
from ketch.operator.spec.model import ServiceSpec
from ketch.operator.spec.model_uri import default_served_name, model_path


def role_settings(svc: ServiceSpec, role: str) -> dict[str, Any]:
    """The role's config file for 'ketch serve': every field the spec sets, plus the role,
    and on a CPU role with ``resources.cpu`` the threads of each worker process
    (``runnable.threads_per_rank``) unless ``engine.numThreads`` sets them."""
    values = engine_fields.engine_settings(svc.spec)
    values["model"] = model_path(svc.spec["model"]["uri"])
    values["served_model_name"] = svc.spec["model"].get("name") or default_served_name(
        svc.spec["model"]["uri"], svc.name
    )
    values["role"] = role
    if role == "prefill":  # speculation happens in decode steps, which prefill pods skip
        values.pop("speculative_config", None)
    resources = svc.role(role)["resources"]
    if resources["gpus"] == 0 and resources.get("cpu") and "num_threads" not in values:
        tp = values.get("tensor_parallel_size", 1)
        values["num_threads"] = runnable.threads_per_rank(resources["cpu"], tp)
    if role == "decode":  # pairing headers may name only these prefill pods' pd-comm ports
        peers = f"{svc.name}-prefill-peers.{svc.namespace}.svc"
        values["pd_prefill_peers"] = f"{peers}:{svc.spec['ports']['pdComm']}"
    if "apiKeySecretRef" in svc.spec.get("auth", {}):
        values["api_key_file"] = API_KEY_PATH
    if role != "mixed" and "peerKeySecretRef" in svc.spec.get("auth", {}):
        values["peer_key_file"] = PEER_KEY_PATH  # read by the engine and its cache manager
    return dict(sorted(values.items()))
