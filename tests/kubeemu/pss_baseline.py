"""The baseline Pod Security Standard's checks (k8s.io/pod-security-admission/policy), with the
apiserver's messages, and the helpers the restricted ones (pss_restricted.py) share.

Each check reads a pod's metadata and spec (plain dicts, after defaulting) and returns None
(allowed) or (reason, detail): the text kube-apiserver joins into `violates PodSecurity
"restricted:latest": reason (detail), ...`. podsecurity.py picks the variant per policy version.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

Obj = dict[str, Any]
Result = tuple[str, str] | None
CheckFn = Callable[[Obj, Obj], Result]


def _containers(spec: Obj) -> Iterator[Obj]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or ()


def _sc(obj: Obj) -> Obj:
    return obj.get("securityContext") or {}


def _plural(singular: str, plural: str, count: int) -> str:
    return singular if count == 1 else plural


def _quote(items: list[str]) -> str:
    return '"' + '", "'.join(items) + '"' if items else ""


def _goq(text: str) -> str:
    """Go's %q for the strings that occur here."""
    return json.dumps(text, ensure_ascii=False)


def _named(items: list[str], singular: str = "container", plural: str = "containers") -> str:
    return f"{_plural(singular, plural, len(items))} {_quote(items)}"


def _windows(spec: Obj) -> bool:
    return ((spec.get("os") or {}).get("name")) == "windows"


def _unless_windows(check: CheckFn) -> CheckFn:
    """The 1.25 variants: Linux-only fields are not required of Windows pods."""
    return lambda meta, spec: None if _windows(spec) else check(meta, spec)


# ------------------------------------------------------------------------------- baseline


def app_armor(meta: Obj, spec: Obj) -> Result:
    allowed = ("RuntimeDefault", "Localhost")
    setters: list[str] = []
    values: set[str] = set()
    profile = _sc(spec).get("appArmorProfile")
    if profile is not None and profile.get("type") not in allowed:
        setters.append("pod")
        values.add(str(profile.get("type") or ""))
    bad = []
    for c in _containers(spec):
        profile = _sc(c).get("appArmorProfile")
        if profile is not None and profile.get("type") not in allowed:
            bad.append(c["name"])
            values.add(str(profile.get("type") or ""))
    if bad:
        setters.append(_named(bad))
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    annotations = sorted(
        f"{k}={_goq(v)}"
        for k, v in (meta.get("annotations") or {}).items()
        if k.startswith(prefix) and v and v != "runtime/default" and not v.startswith("localhost/")
    )
    listed = sorted(values) + annotations
    if annotations:
        setters.append(_plural("annotation", "annotations", len(annotations)))
    if not setters:
        return None
    reason = _plural("forbidden AppArmor profile", "forbidden AppArmor profiles", len(listed))
    return reason, f"{' and '.join(setters)} must not set AppArmor profile type to {_quote(listed)}"


_DEFAULT_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}


def capabilities_baseline(meta: Obj, spec: Obj) -> Result:
    bad, added = [], set()
    for c in _containers(spec):
        add = (_sc(c).get("capabilities") or {}).get("add") or ()
        extra = [str(a) for a in add if a not in _DEFAULT_CAPABILITIES]
        if extra:
            bad.append(c["name"])
            added.update(extra)
    if not bad:
        return None
    listed = _quote(sorted(added))
    return "non-default capabilities", (
        f"{_named(bad)} must not include {listed} in securityContext.capabilities.add"
    )


def host_namespaces(meta: Obj, spec: Obj) -> Result:
    shared = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    return ("host namespaces", ", ".join(shared)) if shared else None


def host_path_volumes(meta: Obj, spec: Obj) -> Result:
    names = [v.get("name", "") for v in spec.get("volumes") or () if v.get("hostPath") is not None]
    return ("hostPath volumes", _named(names, "volume", "volumes")) if names else None


def host_ports(meta: Obj, spec: Obj) -> Result:
    bad, ports = [], set()
    for c in _containers(spec):
        used = [str(p["hostPort"]) for p in c.get("ports") or () if p.get("hostPort")]
        if used:
            bad.append(c["name"])
            ports.update(used)
    if not bad:
        return None
    uses = _plural("uses", "use", len(bad))
    listed = f"{_plural('hostPort', 'hostPorts', len(ports))} {', '.join(sorted(ports))}"
    return "hostPort", f"{_named(bad)} {uses} {listed}"


def privileged(meta: Obj, spec: Obj) -> Result:
    bad = [c["name"] for c in _containers(spec) if _sc(c).get("privileged") is True]
    if not bad:
        return None
    return "privileged", f"{_named(bad)} must not set securityContext.privileged=true"


def proc_mount(meta: Obj, spec: Obj) -> Result:
    bad, types = [], set()
    for c in _containers(spec):
        mount = _sc(c).get("procMount")
        if mount is not None and mount != "Default":
            bad.append(c["name"])
            types.add(str(mount))
    if not bad:
        return None
    return (
        "procMount",
        f"{_named(bad)} must not set securityContext.procMount to {_quote(sorted(types))}",
    )


def _se_linux(allowed_types: frozenset[str]) -> CheckFn:
    def check(meta: Obj, spec: Obj) -> Result:
        types: set[str] = set()
        flags = {"user": False, "role": False}

        def valid(opts: Obj) -> bool:
            ok = True
            if (opts.get("type") or "") not in allowed_types:
                types.add(opts.get("type") or "")
                ok = False
            for key in flags:
                if opts.get(key):
                    flags[key], ok = True, False
            return ok

        setters = []
        pod_opts = _sc(spec).get("seLinuxOptions")
        if pod_opts is not None and not valid(pod_opts):
            setters.append("pod")
        bad = [
            c["name"]
            for c in _containers(spec)
            if _sc(c).get("seLinuxOptions") is not None and not valid(_sc(c)["seLinuxOptions"])
        ]
        if bad:
            setters.append(_named(bad))
        if not setters:
            return None
        data = [f"{_plural('type', 'types', len(types))} {_quote(sorted(types))}"] if types else []
        data += [f"{key} may not be set" for key, was_set in flags.items() if was_set]
        detail = f"{' and '.join(setters)} set forbidden securityContext.seLinuxOptions: "
        return "seLinuxOptions", detail + "; ".join(data)

    return check


_SELINUX_1_0 = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
_SELINUX_1_31 = _SELINUX_1_0 | {"container_engine_t"}


def _seccomp_valid(profile: Obj) -> bool:
    return profile.get("type") in ("RuntimeDefault", "Localhost")


def seccomp_baseline_1_0(meta: Obj, spec: Obj) -> Result:
    def valid(value: str) -> bool:
        return value in ("runtime/default", "docker/default") or value.startswith("localhost/")

    annotations = meta.get("annotations") or {}
    keys = ["seccomp.security.alpha.kubernetes.io/pod"]
    keys += [
        f"container.seccomp.security.alpha.kubernetes.io/{c['name']}" for c in _containers(spec)
    ]
    bad = sorted(
        {
            f"{k}={_goq(annotations[k])}"
            for k in keys
            if k in annotations and not valid(annotations[k])
        }
    )
    if not bad:
        return None
    return (
        "seccompProfile",
        f"forbidden {_plural('annotation', 'annotations', len(bad))} {', '.join(bad)}",
    )


def _seccomp(required: bool) -> CheckFn:
    def check(meta: Obj, spec: Obj) -> Result:
        setters, values, implicit = [], set(), []
        pod_profile = _sc(spec).get("seccompProfile")
        pod_set = False
        if pod_profile is not None:
            if _seccomp_valid(pod_profile):
                pod_set = True
            else:
                setters.append("pod")
                values.add(str(pod_profile.get("type") or ""))
        explicit = []
        for c in _containers(spec):
            profile = _sc(c).get("seccompProfile")
            if profile is not None:
                if not _seccomp_valid(profile):
                    explicit.append(c["name"])
                    values.add(str(profile.get("type") or ""))
            elif not pod_set:
                implicit.append(c["name"])
        if explicit:
            setters.append(_named(explicit))
        if setters:
            detail = f"{' and '.join(setters)} must not set securityContext.seccompProfile.type to"
            return "seccompProfile", f"{detail} {_quote(sorted(values))}"
        if required and implicit:
            detail = (
                'must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"'
            )
            return "seccompProfile", f"pod or {_named(implicit)} {detail}"
        return None

    return check


_SYSCTLS_1_0 = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_unprivileged_port_start",
    }
)
_SYSCTLS_1_27 = _SYSCTLS_1_0 | {"net.ipv4.ip_local_reserved_ports"}
_SYSCTLS_1_29 = _SYSCTLS_1_27 | {
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
_SYSCTLS_1_32 = _SYSCTLS_1_29 | {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}


def _sysctls(allowed: frozenset[str]) -> CheckFn:
    def check(meta: Obj, spec: Obj) -> Result:
        names = [s.get("name", "") for s in _sc(spec).get("sysctls") or ()]
        bad = [n for n in names if n not in allowed]
        return ("forbidden sysctls", ", ".join(bad)) if bad else None

    return check


def windows_host_process(meta: Obj, spec: Obj) -> Result:
    def host_process(sc: Obj) -> bool:
        return (sc.get("windowsOptions") or {}).get("hostProcess") is True

    setters = ["pod"] if host_process(_sc(spec)) else []
    bad = [c["name"] for c in _containers(spec) if host_process(_sc(c))]
    if bad:
        setters.append(_named(bad))
    if not setters:
        return None
    return (
        "hostProcess",
        f"{' and '.join(setters)} must not set securityContext.windowsOptions.hostProcess=true",
    )
