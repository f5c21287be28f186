"""ConfigMap ``N-config``: one ``ketch serve`` config file per role (``<role>.yaml``) and the
router's (``router.yaml``) when the InferenceService has a router. Applied first: every pod
mounts it."""

from __future__ import annotations

import hashlib

from ketch.operator.children.kind import ChildKind, Obj
from ketch.operator.children.roles import has_router
from ketch.operator.objects import instance_labels, metadata
from ketch.operator.spec.engine_config import role_settings
from ketch.operator.spec.model import ServiceSpec
from ketch.operator.yaml_text import dump_yaml


def role_config(svc: ServiceSpec, role: str) -> str:
    return dump_yaml(role_settings(svc, role))


def router_config(svc: ServiceSpec) -> str:
    ports = svc.ports
    domain = f"{svc.namespace}.svc"
    values: Obj = {"port": ports["http"], "policy": svc.spec["router"]["policy"]}
    if svc.disaggregated:
        values["prefill"] = f"{svc.name}-prefill-peers.{domain}"
        values["decode"] = f"{svc.name}-decode-peers.{domain}"
    else:
        values["mixed"] = f"{svc.name}-mixed-peers.{domain}"
    values["engine_port"] = ports["http"]
    if svc.disaggregated:
        values["pd_comm_port"] = ports["pdComm"]
    return dump_yaml(values)


def config_map(svc: ServiceSpec) -> Obj:
    data = {f"{role}.yaml": role_config(svc, role) for role in svc.roles}
    if has_router(svc):
        data["router.yaml"] = router_config(svc)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(svc, f"{svc.name}-config", instance_labels(svc)),
        "data": data,
    }


def config_hash(*texts: str) -> str:
    """A pod template's annotation: a changed config file rolls the pods that read it."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build(svc: ServiceSpec, role: str | None) -> list[Obj]:
    return [config_map(svc)]


KIND = ChildKind(kind="ConfigMap", api_version="v1", plural="configmaps", build=build)
