"""The restricted Pod Security Standard's own checks (k8s.io/pod-security-admission/policy), with
the apiserver's messages; a restricted namespace also runs the baseline ones (pss_baseline.py)
that these do not override. Same contract: None or (reason, detail)."""

from __future__ import annotations

from kubeemu.pss_baseline import Obj, Result, _containers, _named, _plural, _quote, _sc

_ALLOWED_VOLUMES = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
_RESTRICTED_VOLUMES = (  # in the order the apiserver names the first one a volume has
    "hostPath",
    "gcePersistentDisk",
    "awsElasticBlockStore",
    "gitRepo",
    "nfs",
    "iscsi",
    "glusterfs",
    "rbd",
    "flexVolume",
    "cinder",
    "cephfs",
    "flocker",
    "fc",
    "azureFile",
    "vsphereVolume",
    "quobyte",
    "azureDisk",
    "photonPersistentDisk",
    "portworxVolume",
    "scaleIO",
    "storageos",
)


def allow_privilege_escalation(meta: Obj, spec: Obj) -> Result:
    bad = [
        c["name"] for c in _containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False
    ]
    if not bad:
        return None
    return "allowPrivilegeEscalation != false", (
        f"{_named(bad)} must set securityContext.allowPrivilegeEscalation=false"
    )


def capabilities_restricted(meta: Obj, spec: Obj) -> Result:
    missing_drop, adding, added = [], [], set()
    for c in _containers(spec):
        caps = _sc(c).get("capabilities")
        if caps is None:
            missing_drop.append(c["name"])
            continue
        if "ALL" not in (caps.get("drop") or ()):
            missing_drop.append(c["name"])
        extra = [str(a) for a in caps.get("add") or () if a != "NET_BIND_SERVICE"]
        if extra:
            adding.append(c["name"])
            added.update(extra)
    details = []
    if missing_drop:
        details.append(f'{_named(missing_drop)} must set securityContext.capabilities.drop=["ALL"]')
    if adding:
        details.append(
            f"{_named(adding)} must not include {_quote(sorted(added))} in "
            "securityContext.capabilities.add"
        )
    return ("unrestricted capabilities", "; ".join(details)) if details else None


def restricted_volumes(meta: Obj, spec: Obj) -> Result:
    bad, types = [], set()
    for volume in spec.get("volumes") or ():
        if any(volume.get(k) is not None for k in _ALLOWED_VOLUMES):
            continue
        bad.append(volume.get("name", ""))
        kind = next((k for k in _RESTRICTED_VOLUMES if volume.get(k) is not None), "unknown")
        types.add(kind)
    if not bad:
        return None
    uses = _plural("uses", "use", len(bad))
    kinds = _plural("restricted volume type", "restricted volume types", len(types))
    return "restricted volume types", (
        f"{_named(bad, 'volume', 'volumes')} {uses} {kinds} {_quote(sorted(types))}"
    )


def run_as_non_root(meta: Obj, spec: Obj) -> Result:
    setters = []
    pod_value = _sc(spec).get("runAsNonRoot")
    if pod_value is False:
        setters.append("pod")
    explicit, implicit = [], []
    for c in _containers(spec):
        value = _sc(c).get("runAsNonRoot")
        if value is False:
            explicit.append(c["name"])
        elif value is None and pod_value is not True:
            implicit.append(c["name"])
    if explicit:
        setters.append(_named(explicit))
    if setters:
        return "runAsNonRoot != true", (
            f"{' and '.join(setters)} must not set securityContext.runAsNonRoot=false"
        )
    if implicit:
        return "runAsNonRoot != true", (
            f"pod or {_named(implicit)} must set securityContext.runAsNonRoot=true"
        )
    return None


def _root(sc: Obj) -> bool:
    uid = sc.get("runAsUser")
    return isinstance(uid, int) and not isinstance(uid, bool) and uid == 0


def run_as_user(meta: Obj, spec: Obj) -> Result:
    setters = ["pod"] if _root(_sc(spec)) else []
    bad = [c["name"] for c in _containers(spec) if _root(_sc(c))]
    if bad:
        setters.append(_named(bad))
    return ("runAsUser=0", f"{' and '.join(setters)} must not set runAsUser=0") if setters else None
