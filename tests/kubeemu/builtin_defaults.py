"""Defaulting of built-in kinds: the fields operators usually meet (container and pod-spec
defaults, Service cluster IPs and ports, Deployment strategy, ...), modest and deterministic."""

from __future__ import annotations

from typing import Any

from kubeemu.kinds import ResourceType


def _image_pull_policy(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return "IfNotPresent"
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def _default_container(c: dict[str, Any]) -> None:
    for p in c.get("ports") or []:
        if isinstance(p, dict):
            p.setdefault("protocol", "TCP")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    if isinstance(c.get("image"), str):
        c.setdefault("imagePullPolicy", _image_pull_policy(c["image"]))
    c.setdefault("resources", {})
    for env in c.get("env") or []:
        ref = (env.get("valueFrom") or {}).get("fieldRef") if isinstance(env, dict) else None
        if isinstance(ref, dict):
            ref.setdefault("apiVersion", "v1")


def default_pod_spec(spec: dict[str, Any]) -> None:
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            if isinstance(c, dict):
                _default_container(c)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for v in spec.get("volumes") or []:
        if not isinstance(v, dict):
            continue
        for src in ("configMap", "secret"):
            if isinstance(v.get(src), dict):
                v[src].setdefault("defaultMode", 420)
        if "emptyDir" in v and v["emptyDir"] is None:
            v["emptyDir"] = {}


def apply_defaults(rt: ResourceType, obj: dict[str, Any], ip_alloc: Any = None) -> None:
    """Modest, deterministic defaulting of built-in kinds, in place."""
    if rt.is_crd:
        return
    key = rt.key
    spec = obj.get("spec")
    if key == ("apps", "deployments") and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
        strategy = spec.setdefault("strategy", {})
        if isinstance(strategy, dict):
            strategy.setdefault("type", "RollingUpdate")
            if strategy["type"] == "RollingUpdate":
                ru = strategy.setdefault("rollingUpdate", {})
                ru.setdefault("maxUnavailable", "25%")
                ru.setdefault("maxSurge", "25%")
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        tmpl_spec = (spec.get("template") or {}).get("spec")
        if isinstance(tmpl_spec, dict):
            default_pod_spec(tmpl_spec)
    elif key == ("apps", "replicasets") and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
        tmpl_spec = (spec.get("template") or {}).get("spec")
        if isinstance(tmpl_spec, dict):
            default_pod_spec(tmpl_spec)
    elif key == ("", "pods"):
        if isinstance(spec, dict):
            default_pod_spec(spec)
            spec.setdefault("serviceAccountName", "default")
            spec.setdefault("enableServiceLinks", True)
            spec.setdefault("priority", 0)
        obj.setdefault("status", {}).setdefault("phase", "Pending")
    elif key == ("", "services") and isinstance(spec, dict):
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        for p in spec.get("ports") or []:
            if isinstance(p, dict):
                p.setdefault("protocol", "TCP")
                if "port" in p:
                    p.setdefault("targetPort", p["port"])
        if spec["type"] != "ExternalName":
            if "clusterIP" not in spec and ip_alloc is not None:
                spec["clusterIP"] = ip_alloc()
            if "clusterIP" in spec:
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
            spec.setdefault("ipFamilies", ["IPv4"])
            spec.setdefault("ipFamilyPolicy", "SingleStack")
            spec.setdefault("internalTrafficPolicy", "Cluster")
        obj.setdefault("status", {}).setdefault("loadBalancer", {})
    elif key == ("", "secrets"):
        obj.setdefault("type", "Opaque")
        string_data = obj.pop("stringData", None)
        if isinstance(string_data, dict):
            import base64

            data = obj.setdefault("data", {})
            for k, v in string_data.items():
                data[k] = base64.b64encode(str(v).encode()).decode()
    elif key == ("", "namespaces"):
        name = (obj.get("metadata") or {}).get("name")
        if name:
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")
    elif key == ("networking.k8s.io", "networkpolicies") and isinstance(spec, dict):
        spec.setdefault("policyTypes", ["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])


def keep_allocated_service_fields(old: dict[str, Any], new: dict[str, Any]) -> None:
    """An update that leaves out the allocated cluster IP keeps it (as the real server does)."""
    old_spec, spec = old.get("spec") or {}, new.get("spec")
    if not isinstance(spec, dict):
        return
    for key in ("clusterIP", "clusterIPs"):
        if key not in spec and key in old_spec:
            spec[key] = old_spec[key]
