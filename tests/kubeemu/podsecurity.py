"""Pod Security admission: the `pod-security.kubernetes.io/*` namespace labels, enforced as
kube-apiserver's PodSecurity plugin enforces them.

- Pods (create, and updates that change images or containers) in a namespace whose `enforce`
  level they violate are refused: 403 `pods "x" is forbidden: violates PodSecurity
  "restricted:latest": ...`. That holds for the pods the emulator's ReplicaSet controller
  creates too, so a Deployment with a violating template gets no pods.
- Workloads with a pod template (Deployments, ReplicaSets, StatefulSets, DaemonSets, Jobs,
  CronJobs, ReplicationControllers, PodTemplates) are admitted, with a `Warning` header
  `would violate PodSecurity "restricted:latest": ...` under the `warn` level (which defaults to
  an explicitly set, stricter `enforce` level).
- Namespaces: invalid level/version labels are refused (422); tightening `enforce` warns about
  the existing pods that would violate it.
The checks are pss_baseline.py and pss_restricted.py, evaluated as of v1.32 (the version the
emulator reports; `latest` and newer versions mean that). Not modelled: `audit` (annotations in
the audit log), exemptions (none are configured by default), an admission configuration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubeemu import pss_baseline as b
from kubeemu import pss_restricted as r
from kubeemu.errors import ApiError, invalid
from kubeemu.kinds import ResourceType

if TYPE_CHECKING:
    from kubeemu.store import Store

Obj = dict[str, Any]
Version = tuple[int, int]
MAX_VERSION: Version = (1, 32)  # the emulator's kube-apiserver (discovery.VERSION_INFO)
PREFIX = "pod-security.kubernetes.io/"
LEVELS = ("privileged", "baseline", "restricted")
POD_CONTROLLERS = {
    ("", "podtemplates"),
    ("", "replicationcontrollers"),
    ("apps", "replicasets"),
    ("apps", "deployments"),
    ("apps", "statefulsets"),
    ("apps", "daemonsets"),
    ("batch", "jobs"),
    ("batch", "cronjobs"),
}
_IGNORED_POD_SUBRESOURCES = {
    "exec",
    "attach",
    "binding",
    "eviction",
    "log",
    "portforward",
    "proxy",
    "status",
}


@dataclass(frozen=True)
class Check:
    """One check: its ID (messages are ordered by it), level, and variants by policy version."""

    id: str
    level: str
    versions: tuple[tuple[Version, b.CheckFn], ...]
    overrides: tuple[str, ...] = ()  # baseline checks a restricted one replaces


CHECKS = (
    Check("appArmorProfile", "baseline", (((1, 0), b.app_armor),)),
    Check("capabilities_baseline", "baseline", (((1, 0), b.capabilities_baseline),)),
    Check("hostNamespaces", "baseline", (((1, 0), b.host_namespaces),)),
    Check("hostPathVolumes", "baseline", (((1, 0), b.host_path_volumes),)),
    Check("hostPorts", "baseline", (((1, 0), b.host_ports),)),
    Check("privileged", "baseline", (((1, 0), b.privileged),)),
    Check("procMount", "baseline", (((1, 0), b.proc_mount),)),
    Check(
        "seLinuxOptions",
        "baseline",
        (((1, 0), b._se_linux(b._SELINUX_1_0)), ((1, 31), b._se_linux(b._SELINUX_1_31))),
    ),
    Check(
        "seccompProfile_baseline",
        "baseline",
        (((1, 0), b.seccomp_baseline_1_0), ((1, 19), b._seccomp(required=False))),
    ),
    Check(
        "sysctls",
        "baseline",
        (
            ((1, 0), b._sysctls(b._SYSCTLS_1_0)),
            ((1, 27), b._sysctls(b._SYSCTLS_1_27)),
            ((1, 29), b._sysctls(b._SYSCTLS_1_29)),
            ((1, 32), b._sysctls(b._SYSCTLS_1_32)),
        ),
    ),
    Check("windowsHostProcess", "baseline", (((1, 0), b.windows_host_process),)),
    Check(
        "allowPrivilegeEscalation",
        "restricted",
        (
            ((1, 8), r.allow_privilege_escalation),
            ((1, 25), b._unless_windows(r.allow_privilege_escalation)),
        ),
    ),
    Check(
        "capabilities_restricted",
        "restricted",
        (
            ((1, 22), r.capabilities_restricted),
            ((1, 25), b._unless_windows(r.capabilities_restricted)),
        ),
        ("capabilities_baseline",),
    ),
    Check(
        "restrictedVolumes", "restricted", (((1, 0), r.restricted_volumes),), ("hostPathVolumes",)
    ),
    Check("runAsNonRoot", "restricted", (((1, 0), r.run_as_non_root),)),
    Check("runAsUser", "restricted", (((1, 23), r.run_as_user),)),
    Check(
        "seccompProfile_restricted",
        "restricted",
        (
            ((1, 19), b._seccomp(required=True)),
            ((1, 25), b._unless_windows(b._seccomp(required=True))),
        ),
        ("seccompProfile_baseline",),
    ),
)


@dataclass(frozen=True)
class LevelVersion:
    level: str
    version: Version | None = None  # None: latest

    def __str__(self) -> str:
        version = "latest" if self.version is None else f"v{self.version[0]}.{self.version[1]}"
        return f"{self.level}:{version}"


def checks_for(lv: LevelVersion) -> list[b.CheckFn]:
    """The checks a level and version run, in the apiserver's order (baseline IDs sorted, then
    restricted IDs sorted), without the baseline checks a restricted one overrides."""
    if lv.level == "privileged":
        return []
    version = MAX_VERSION if lv.version is None else min(lv.version, MAX_VERSION)
    active: dict[str, tuple[Check, b.CheckFn]] = {}
    for check in CHECKS:
        if check.level == "restricted" and lv.level != "restricted":
            continue
        fns = [fn for since, fn in check.versions if since <= version]
        if fns:
            active[check.id] = (check, fns[-1])
    dropped = {o for check, _ in active.values() for o in check.overrides}
    order = sorted(i for i, (c, _) in active.items() if c.level == "baseline")
    order += sorted(i for i, (c, _) in active.items() if c.level == "restricted")
    return [active[i][1] for i in order if i not in dropped]


def evaluate(lv: LevelVersion, meta: Obj, spec: Obj) -> list[tuple[str, str]]:
    """(reason, detail) of every check the pod(-like) fails."""
    return [found for check in checks_for(lv) if (found := check(meta, spec)) is not None]


def describe(failures: list[tuple[str, str]]) -> str:
    return ", ".join(f"{reason} ({detail})" if detail else reason for reason, detail in failures)


# --------------------------------------------------------------------------- namespace policy


@dataclass(frozen=True)
class Policy:
    enforce: LevelVersion
    audit: LevelVersion
    warn: LevelVersion

    def fully_privileged(self) -> bool:
        return all(lv.level == "privileged" for lv in (self.enforce, self.audit, self.warn))


_VERSION = re.compile(r"v1\.(0|[1-9][0-9]*)")


def policy_of(labels: Mapping[str, str] | None) -> tuple[Policy, list[Obj]]:
    """The namespace's policy and the errors in its labels (api.PolicyToEvaluate)."""
    labels = labels or {}
    errors: list[Obj] = []
    modes: dict[str, list[Any]] = {m: ["privileged", None] for m in ("enforce", "audit", "warn")}
    for mode in modes:
        level = labels.get(PREFIX + mode)
        if level is not None:
            if level in LEVELS:
                modes[mode][0] = level
            else:
                errors.append(_label_error(mode, level, "must be one of " + ", ".join(LEVELS)))
                modes[mode][0] = "restricted" if mode == "enforce" else "privileged"
        version = labels.get(f"{PREFIX}{mode}-version")
        if version is not None:
            if version == "latest":
                modes[mode][1] = None
            elif (m := _VERSION.fullmatch(version)) is not None:
                modes[mode][1] = (1, int(m.group(1)))
            else:
                errors.append(
                    _label_error(f"{mode}-version", version, 'must be "latest" or "v1.x"')
                )
    enforce_level = labels.get(PREFIX + "enforce")
    if (
        PREFIX + "warn" not in labels
        and enforce_level in LEVELS
        and LEVELS.index(modes["enforce"][0]) > LEVELS.index(modes["warn"][0])
    ):
        modes["warn"][0] = modes["enforce"][0]
        if PREFIX + "warn-version" not in labels:
            modes["warn"][1] = modes["enforce"][1]
    policy = Policy(*(LevelVersion(level, version) for level, version in modes.values()))
    return policy, errors


def _label_error(label: str, value: str, why: str) -> Obj:
    return {
        "reason": "FieldValueInvalid",
        "field": f"metadata.labels[{PREFIX}{label}]",
        "message": f'Invalid value: "{value}": {why}',
    }


# --------------------------------------------------------------------------- admission


def admit(
    store: Store, rt: ResourceType, new: Obj, old: Obj | None, subresource: str | None
) -> list[str]:
    """Warnings for the write; ApiError when a pod violates its namespace's enforce level."""
    if rt.key == ("", "namespaces"):
        return _namespace(store, rt, new, old) if not subresource else []
    if rt.key == ("", "pods"):
        if subresource in _IGNORED_POD_SUBRESOURCES:
            return []
        if old is not None and not _significant(new.get("spec") or {}, old.get("spec") or {}):
            return []
        return _pod(store, new)
    if rt.key in POD_CONTROLLERS and not subresource:
        template = _template(rt, new)
        return [] if template is None else _controller(store, new, template)
    return []


def _labels_of(store: Store, namespace: str) -> Mapping[str, str]:
    ns = store.peek(("", "namespaces"), None, namespace)
    return ((ns or {}).get("metadata") or {}).get("labels") or {}


def _pod(store: Store, pod: Obj) -> list[str]:
    meta = pod.get("metadata") or {}
    policy, errors = policy_of(_labels_of(store, meta.get("namespace") or ""))
    if not errors and policy.fully_privileged():
        return []
    spec = pod.get("spec") or {}
    failures = evaluate(policy.enforce, meta, spec)
    if failures:
        name = meta.get("name") or ""
        raise ApiError(
            403,
            "Forbidden",
            f'pods "{name}" is forbidden: violates PodSecurity "{policy.enforce}": '
            + describe(failures),
            {"name": name, "kind": "pods"},
        )
    if policy.warn == policy.enforce:
        return []
    return _would_violate(policy.warn, meta, spec)


def _controller(store: Store, obj: Obj, template: Obj) -> list[str]:
    namespace = (obj.get("metadata") or {}).get("namespace") or ""
    policy, errors = policy_of(_labels_of(store, namespace))
    if not errors and policy.warn.level == policy.audit.level == "privileged":
        return []
    return _would_violate(policy.warn, template.get("metadata") or {}, template.get("spec") or {})


def _would_violate(lv: LevelVersion, meta: Obj, spec: Obj) -> list[str]:
    failures = evaluate(lv, meta, spec)
    return [f'would violate PodSecurity "{lv}": {describe(failures)}'] if failures else []


def _template(rt: ResourceType, obj: Obj) -> Obj | None:
    if rt.key == ("", "podtemplates"):
        return obj.get("template")
    spec = obj.get("spec") or {}
    if rt.key == ("batch", "cronjobs"):
        spec = ((spec.get("jobTemplate") or {}).get("spec")) or {}
    return spec.get("template")


def _significant(new: Obj, old: Obj) -> bool:
    """Only image and container changes can make a stored pod violate (isSignificantPodUpdate)."""
    for key in ("containers", "initContainers"):
        now, before = new.get(key) or [], old.get(key) or []
        if len(now) != len(before):
            return True
        if any(x.get("image") != y.get("image") for x, y in zip(now, before, strict=True)):
            return True
    olds = {c.get("name"): c for c in old.get("ephemeralContainers") or ()}
    for c in new.get("ephemeralContainers") or ():
        prior = olds.get(c.get("name"))
        if prior is None or prior.get("image") != c.get("image"):
            return True
    return False


def _namespace(store: Store, rt: ResourceType, new: Obj, old: Obj | None) -> list[str]:
    name = (new.get("metadata") or {}).get("name") or ""
    policy, errors = policy_of((new.get("metadata") or {}).get("labels"))
    if old is None:
        if errors:
            raise invalid(rt, name, errors)
        return []
    old_policy, old_errors = policy_of((old.get("metadata") or {}).get("labels"))
    if errors and (not old_errors or errors != old_errors):
        raise invalid(rt, name, errors)
    new_lv, old_lv = policy.enforce, old_policy.enforce
    if new_lv == old_lv or new_lv.level == "privileged":
        return []
    if new_lv.version == old_lv.version and LEVELS.index(new_lv.level) <= LEVELS.index(
        old_lv.level
    ):
        return []
    return _existing_pods(store, name, new_lv)


def _existing_pods(store: Store, namespace: str, lv: LevelVersion) -> list[str]:
    """Which existing pods the new enforce level would refuse (EvaluatePodsInNamespace)."""
    pods = [
        p for (ns, _), p in sorted(store.objects.get(("", "pods"), {}).items()) if ns == namespace
    ]
    first, rest, seen = [], [], set()
    for pod in pods:
        owner = next(
            (
                o.get("uid")
                for o in pod["metadata"].get("ownerReferences") or ()
                if o.get("controller")
            ),
            None,
        )
        (rest if owner is not None and owner in seen else first).append(pod)
        if owner is not None:
            seen.add(owner)
    counts: dict[str, list[Any]] = {}
    for pod in first + rest:
        failures = evaluate(lv, pod["metadata"], pod.get("spec") or {})
        if failures:
            reason = ", ".join(reason for reason, _ in failures)
            entry = counts.setdefault(reason, [pod["metadata"]["name"], 0])
            entry[0] = min(entry[0], pod["metadata"]["name"])
            entry[1] += 1
    if not counts:
        return []
    decorated = []
    for reason, (pod_name, count) in counts.items():
        others = {1: "", 2: " (and 1 other pod)"}.get(count, f" (and {count - 1} other pods)")
        decorated.append(f"{pod_name}{others}: {reason}")
    head = (
        f'existing pods in namespace "{namespace}" violate the new PodSecurity enforce level "{lv}"'
    )
    return [head, *sorted(decorated)]
