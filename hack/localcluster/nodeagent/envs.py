"""A container's environment and command line, resolved as the kubelet resolves them.

Pure functions (the ConfigMaps and Secrets come through a ``lookup`` callable):

- ``container_env``: ``envFrom`` then ``env`` in order, each ``value`` expanded with ``$(VAR)``
  against the variables defined before it and the Service variables; ``valueFrom`` fieldRef,
  resourceFieldRef, configMapKeyRef and secretKeyRef (with ``optional``); then the Service
  variables not already defined (``service_env``). A missing non-optional source raises
  ConfigError, which the pod reports as CreateContainerConfigError.
- ``command_line``: ``command`` replaces the image's ENTRYPOINT, ``args`` its CMD (and ``command``
  without ``args`` drops the CMD), each word expanded against the resolved environment.

The image's own ENV is not visible to ``$(VAR)`` (the kubelet does not know it either); the
runtime puts it under the container's variables (``runtime``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]
# (kind, name) -> the object's data (Secret data decoded), or None if it does not exist
Lookup = Callable[[str, str], "dict[str, str | bytes] | None"]

_SUFFIXES = {
    "": 1, "m": Fraction(1, 1000), "u": Fraction(1, 10**6), "n": Fraction(1, 10**9),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|([a-zA-Z]*))$")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['(.*)'\]$")
# Since Kubernetes 1.34 any printable ASCII but '=' may name a variable.
_ENV_NAME = re.compile(r"^[\x20-\x3c\x3e-\x7e]+$")


class ConfigError(Exception):
    """The container cannot be configured (missing ConfigMap, Secret or key; a bad field)."""


def parse_quantity(text: str | int | float) -> Fraction:
    """A resource.Quantity ("100m", "1Gi", "1.5", "2e3") as an exact number."""
    match = _QUANTITY.match(str(text).strip())
    if not match or (match.group(3) or "") not in _SUFFIXES:
        raise ValueError(f"not a quantity: {text!r}")
    number = Fraction(match.group(1))
    if match.group(2):
        return number * Fraction(10) ** int(match.group(2)[1:])
    return number * _SUFFIXES[match.group(3)]


def expand(text: str, mapping: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined VAR is replaced, an undefined one left as
    written, ``$$`` is a literal ``$``, any other ``$`` stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end == -1:
                    out.append(text[i:])
                    break
                name = text[i + 2 : end]
                out.append(mapping[name] if name in mapping else text[i : end + 1])
                i = end + 1
                continue
            out.append(text[i : i + 2])
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def field_value(pod: Obj, path: str) -> str:
    """A downward-API fieldRef of ``pod`` (whose status carries this node's podIP/hostIP)."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    match = _FIELD_KEY.match(path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):  # volumes only: k="v" lines
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "".join(f'{k}="{_quote(v)}"\n' for k, v in items)
    values = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", [])),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", [])),
    }
    if path not in values:
        raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return values[path]


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def resource_value(container: Obj, ref: Obj, allocatable: Mapping[str, str]) -> str:
    """A resourceFieldRef: ``limits.cpu`` etc. of ``container``, a missing limit being the node's
    allocatable amount, rounded up to whole ``divisor`` units."""
    kind, _, resource = ref["resource"].partition(".")
    if kind not in ("limits", "requests") or not resource:
        raise ConfigError(f"unsupported resourceFieldRef resource {ref['resource']!r}")
    amounts = container.get("resources", {}).get(kind, {})
    if resource in amounts:
        value = parse_quantity(amounts[resource])
    elif kind == "limits":
        value = parse_quantity(allocatable.get(resource, "0"))
    else:
        value = Fraction(0)
    divisor = parse_quantity(ref.get("divisor") or "1")
    if divisor <= 0:
        raise ConfigError(f"resourceFieldRef divisor {ref.get('divisor')!r} must be positive")
    return str(math.ceil(value / divisor))


def _key_ref(lookup: Lookup, kind: str, ref: Obj, namespace: str) -> str | None:
    label = "ConfigMap" if kind == "configmap" else "Secret"
    data = lookup(kind, ref["name"])
    if data is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind} "{ref["name"]}" not found')
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {label} {namespace}/{ref['name']}")
    return _text(data[ref["key"]])


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def container_env(
    pod: Obj,
    container: Obj,
    lookup: Lookup,
    service_env: Mapping[str, str],
    allocatable: Mapping[str, str],
) -> dict[str, str]:
    """The container's variables in the kubelet's order (ConfigError if one cannot be made)."""
    namespace = pod["metadata"].get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        kind = "configmap" if "configMapRef" in source else "secret"
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        data = lookup(kind, ref.get("name", ""))
        if data is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f'{kind} "{ref.get("name")}" not found')
        for key, value in data.items():
            name = source.get("prefix", "") + key
            if _ENV_NAME.match(name):  # invalid names are skipped, as the kubelet does
                env[name] = _text(value)
    mapping = _Chain(env, service_env)
    for item in container.get("env", []):
        name = item["name"]
        source = item.get("valueFrom")
        if item.get("value") or not source:
            env[name] = expand(item.get("value", ""), mapping)
            continue
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"], allocatable)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configmap" if "configMapKeyRef" in source else "secret"
            ref = source.get("configMapKeyRef") or source["secretKeyRef"]
            value = _key_ref(lookup, kind, ref, namespace)
            if value is not None:
                env[name] = value
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
    for name, value in service_env.items():
        env.setdefault(name, value)
    return env


class _Chain(Mapping[str, str]):
    """The variables defined so far, then the Service variables (expansion's lookup order)."""

    def __init__(self, first: Mapping[str, str], second: Mapping[str, str]) -> None:
        self.first, self.second = first, second

    def __getitem__(self, key: str) -> str:
        return self.first[key] if key in self.first else self.second[key]

    def __contains__(self, key: object) -> bool:
        return key in self.first or key in self.second

    def __iter__(self) -> Any:
        return iter({**self.second, **self.first})

    def __len__(self) -> int:
        return len({**self.second, **self.first})


def service_env(services: list[Obj], kubernetes_ip: str, enable_links: bool) -> dict[str, str]:
    """Docker-link style variables: always the ``kubernetes`` Service's (ClusterIP
    ``kubernetes_ip``, port 443), and with ``enableServiceLinks`` (the default) those of every
    Service of the pod's namespace that has a ClusterIP."""
    env: dict[str, str] = {}
    chosen = services if enable_links else []
    for svc in chosen:
        ip = svc.get("spec", {}).get("clusterIP")
        if ip and ip != "None":
            env |= _links(svc["metadata"]["name"], ip, svc["spec"].get("ports", []))
    return env | _links("kubernetes", kubernetes_ip, [{"name": "https", "port": 443}])


def _links(name: str, ip: str, ports: list[Obj]) -> dict[str, str]:
    prefix = name.upper().replace("-", "_")
    env = {f"{prefix}_SERVICE_HOST": ip}
    if not ports:
        return env
    env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
    for port in ports:
        proto = port.get("protocol", "TCP")
        if port.get("name"):
            env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                port["port"]
            )
        base = f"{prefix}_PORT_{port['port']}_{proto.upper()}"
        env[base] = f"{proto.lower()}://{ip}:{port['port']}"
        env[f"{base}_PROTO"] = proto.lower()
        env[f"{base}_PORT"] = str(port["port"])
        env[f"{base}_ADDR"] = ip
    first = ports[0]
    env[f"{prefix}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
    return env


def command_line(
    container: Obj, entrypoint: list[str], cmd: list[str], env: Mapping[str, str]
) -> list[str]:
    """The argv a container runs: Kubernetes' command/args over the image's ENTRYPOINT/CMD."""
    if container.get("command"):
        words = [*container["command"], *container.get("args", [])]
        return [expand(w, env) for w in words]
    args = container.get("args")
    if args:
        return [*entrypoint, *(expand(w, env) for w in args)]
    return [*entrypoint, *cmd]
