"""Decode the Kubernetes protobuf encoding for a few simple kinds.

kubectl's imperative commands (`kubectl create namespace|configmap|secret|serviceaccount`) send
`application/vnd.kubernetes.protobuf` bodies and do not fall back to JSON. This decodes those
kinds (field numbers from k8s.io/api/core/v1/generated.proto) into the JSON form; other kinds
are refused with 415 by the caller.
"""

from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"

# A schema maps field number -> (json name, type). Types: "string", "bytes", "bool", "int64",
# "map_ss" (map<string,string>), "map_sb" (map<string,bytes>, base64 in JSON), "[string]"
# (repeated string), a nested schema dict, or ("repeated", schema).
_OWNER_REF = {
    5: ("apiVersion", "string"),
    1: ("kind", "string"),
    3: ("name", "string"),
    4: ("uid", "string"),
    6: ("controller", "bool"),
    7: ("blockOwnerDeletion", "bool"),
}
_OBJECT_META: dict[int, tuple[str, Any]] = {
    1: ("name", "string"),
    2: ("generateName", "string"),
    3: ("namespace", "string"),
    11: ("labels", "map_ss"),
    12: ("annotations", "map_ss"),
    13: ("ownerReferences", ("repeated", _OWNER_REF)),
    14: ("finalizers", "[string]"),
}
_LOCAL_REF = {1: ("name", "string")}
_OBJECT_REF = {
    1: ("kind", "string"),
    2: ("namespace", "string"),
    3: ("name", "string"),
    4: ("uid", "string"),
    5: ("apiVersion", "string"),
}

SCHEMAS: dict[tuple[str, str], dict[int, tuple[str, Any]]] = {
    ("v1", "Namespace"): {
        1: ("metadata", _OBJECT_META),
        2: ("spec", {1: ("finalizers", "[string]")}),
    },
    ("v1", "ConfigMap"): {
        1: ("metadata", _OBJECT_META),
        2: ("data", "map_ss"),
        3: ("binaryData", "map_sb"),
        4: ("immutable", "bool"),
    },
    ("v1", "Secret"): {
        1: ("metadata", _OBJECT_META),
        2: ("data", "map_sb"),
        3: ("type", "string"),
        4: ("stringData", "map_ss"),
        5: ("immutable", "bool"),
    },
    ("v1", "ServiceAccount"): {
        1: ("metadata", _OBJECT_META),
        2: ("secrets", ("repeated", _OBJECT_REF)),
        3: ("imagePullSecrets", ("repeated", _LOCAL_REF)),
        4: ("automountServiceAccountToken", "bool"),
    },
    # `kubectl create token` and `kubectl auth can-i` (access.py answers them)
    ("authentication.k8s.io/v1", "TokenRequest"): {
        1: ("metadata", _OBJECT_META),
        2: ("spec", {1: ("audiences", "[string]"), 4: ("expirationSeconds", "int64")}),
    },
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): {
        1: ("metadata", _OBJECT_META),
        2: (
            "spec",
            {
                1: (
                    "resourceAttributes",
                    {
                        1: ("namespace", "string"),
                        2: ("verb", "string"),
                        3: ("group", "string"),
                        4: ("version", "string"),
                        5: ("resource", "string"),
                        6: ("subresource", "string"),
                        7: ("name", "string"),
                    },
                ),
                2: ("nonResourceAttributes", {1: ("path", "string"), 2: ("verb", "string")}),
            },
        ),
    },
}


class ProtobufError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtobufError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) for every field of a message."""
    out = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value = buf[pos : pos + length]
            if len(value) != length:
                raise ProtobufError("truncated field")
            pos += length
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
        out.append((number, wire, value))
    return out


def _message(buf: bytes, schema: dict[int, tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, _wire, value in _fields(buf):
        if number not in schema:
            continue
        name, ftype = schema[number]
        if ftype == "string":
            if value:
                out[name] = value.decode()
        elif ftype == "bytes":
            out[name] = base64.b64encode(value).decode()
        elif ftype == "bool":
            out[name] = bool(value)
        elif ftype == "int64":
            out[name] = value
        elif ftype in ("map_ss", "map_sb"):
            entry = {n: v for n, _w, v in _fields(value)}
            key = entry.get(1, b"").decode()
            raw = entry.get(2, b"")
            out.setdefault(name, {})[key] = (
                raw.decode() if ftype == "map_ss" else base64.b64encode(raw).decode()
            )
        elif ftype == "[string]":
            out.setdefault(name, []).append(value.decode())
        elif isinstance(ftype, tuple):
            out.setdefault(name, []).append(_message(value, ftype[1]))
        else:
            sub = _message(value, ftype)
            if sub:
                out[name] = sub
    return out


def decode(body: bytes) -> dict[str, Any]:
    """A protobuf-encoded object (runtime.Unknown envelope) as its JSON form."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf magic prefix")
    envelope = {n: v for n, _w, v in _fields(body[len(MAGIC) :])}
    type_meta = {n: v for n, _w, v in _fields(envelope.get(1, b""))}
    api_version = type_meta.get(1, b"").decode()
    kind = type_meta.get(2, b"").decode()
    schema = SCHEMAS.get((api_version, kind))
    if schema is None:
        raise ProtobufError(f"protobuf bodies of {api_version}/{kind} are not supported")
    obj = {"apiVersion": api_version, "kind": kind}
    obj.update(_message(envelope.get(2, b""), schema))
    return obj
