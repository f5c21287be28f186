"""Validation of object names and label maps, in kube-apiserver's words: DNS-1123 subdomains
and labels, DNS-1035 labels (Services), qualified label keys and label values."""

from __future__ import annotations

import re
from typing import Any

from kubeemu.kinds import ResourceType

DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{DNS1123_LABEL}(\.{DNS1123_LABEL})*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"

MSG_SUBDOMAIN = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    f"regex used for validation is '{_DNS1123_SUBDOMAIN}')"
)
MSG_LABEL_1123 = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    f"regex used for validation is '{DNS1123_LABEL}')"
)
MSG_LABEL_1035 = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
    "an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    f"'abc-123', regex used for validation is '{_DNS1035_LABEL}')"
)


def field_cause(field_path: str, reason: str, message: str) -> dict[str, str]:
    return {"reason": reason, "field": field_path, "message": message}


def quoted(value: Any) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def validate_name(rt: ResourceType, name: str) -> list[dict[str, str]]:
    if rt.plural == "namespaces":
        pattern, msg, limit = DNS1123_LABEL, MSG_LABEL_1123, 63
    elif rt.plural == "services":
        pattern, msg, limit = _DNS1035_LABEL, MSG_LABEL_1035, 63
    else:
        pattern, msg, limit = _DNS1123_SUBDOMAIN, MSG_SUBDOMAIN, 253
    errs = []
    if len(name) > limit:
        errs.append(
            field_cause(
                "metadata.name",
                "FieldValueInvalid",
                f"Invalid value: {quoted(name)}: must be no more than {limit} characters",
            )
        )
    if not re.fullmatch(pattern, name):
        errs.append(
            field_cause(
                "metadata.name", "FieldValueInvalid", f"Invalid value: {quoted(name)}: {msg}"
            )
        )
    return errs


def validate_labels(labels: Any, field_path: str) -> list[dict[str, str]]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [field_cause(field_path, "FieldValueInvalid", "Invalid value: must be a map")]
    errs = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        bad_key = (
            not name
            or len(name) > 63
            or not re.fullmatch(_QUALIFIED_NAME, name)
            or (prefix and (len(prefix) > 253 or not re.fullmatch(_DNS1123_SUBDOMAIN, prefix)))
        )
        if bad_key:
            errs.append(
                field_cause(
                    field_path,
                    "FieldValueInvalid",
                    f"Invalid value: {quoted(key)}: name part must consist of alphanumeric "
                    "characters, '-', '_' or '.', and must start and end with an alphanumeric "
                    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
                    f"validation is '{_QUALIFIED_NAME}')",
                )
            )
        if not isinstance(value, str):
            errs.append(
                field_cause(field_path, "FieldValueInvalid", "Invalid value: must be a string")
            )
            continue
        if len(value) > 63:
            errs.append(
                field_cause(
                    field_path,
                    "FieldValueInvalid",
                    f"Invalid value: {quoted(value)}: must be no more than 63 characters",
                )
            )
        if not re.fullmatch(_LABEL_VALUE, value):
            errs.append(
                field_cause(
                    field_path,
                    "FieldValueInvalid",
                    f"Invalid value: {quoted(value)}: a valid label must be an empty string "
                    "or consist of alphanumeric characters, '-', '_' or '.', and must start and "
                    "end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                    f"'12345', regex used for validation is '{_LABEL_VALUE}')",
                )
            )
    return errs
