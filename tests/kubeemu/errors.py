"""The errors kube-apiserver answers with (a `Status` object), shaped as it shapes them."""

from __future__ import annotations

from typing import Any

from kubeemu.kinds import ResourceType


class ApiError(Exception):
    """An error the API answers with a `Status` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            out["details"] = self.details
        out["code"] = self.code
        return out


def details_of(rt: ResourceType, name: str, kind: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name}
    if rt.group:
        d["group"] = rt.group
    d["kind"] = kind or rt.plural
    return d


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', details_of(rt, name))


def namespace_not_found(ns: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
    )


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', details_of(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or (
        "the object has been modified; please apply your changes to the latest version "
        "and try again"
    )
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
        details_of(rt, name),
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(rt: ResourceType, name: str, causes: list[dict[str, str]]) -> ApiError:
    texts = [f"{c.get('field', '')}: {c.get('message', '')}" for c in causes]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details = details_of(rt, name, rt.kind)
    details["causes"] = [
        {
            "reason": c.get("reason", "FieldValueInvalid"),
            "message": c.get("message", ""),
            "field": c.get("field", ""),
        }
        for c in causes
    ]
    return ApiError(422, "Invalid", f'{rt.qualified_kind} "{name}" is invalid: {joined}', details)
