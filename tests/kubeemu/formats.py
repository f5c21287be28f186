"""String formats kube-apiserver checks in CRD schemas (a useful subset; unknown formats pass,
as there)."""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import ipaddress
import re

_UUID = r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
_FORMAT_RES = {
    "uuid": re.compile(rf"^{_UUID}$"),
    "uuid3": re.compile(
        r"^[0-9a-f]{8}-?[0-9a-f]{4}-?3[0-9a-f]{3}-?[0-9a-f]{4}-?[0-9a-f]{12}$", re.I
    ),
    "uuid4": re.compile(
        r"^[0-9a-f]{8}-?[0-9a-f]{4}-?4[0-9a-f]{3}-?[89ab][0-9a-f]{3}-?[0-9a-f]{12}$", re.I
    ),
    "uuid5": re.compile(
        r"^[0-9a-f]{8}-?[0-9a-f]{4}-?5[0-9a-f]{3}-?[89ab][0-9a-f]{3}-?[0-9a-f]{12}$", re.I
    ),
    "hostname": re.compile(
        r"^([a-zA-Z0-9]([-a-zA-Z0-9]{0,61}[a-zA-Z0-9])?)(\.[a-zA-Z0-9]([-a-zA-Z0-9]{0,61}"
        r"[a-zA-Z0-9])?)*\.?$"
    ),
    "email": re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$"),
    "mac": re.compile(r"^([0-9a-fA-F]{2}[:-]){5}[0-9a-fA-F]{2}$"),
    "hexcolor": re.compile(r"^#?([0-9a-fA-F]{3}|[0-9a-fA-F]{6})$"),
    "rgbcolor": re.compile(r"^rgb\(\s*\d{1,3}\s*,\s*\d{1,3}\s*,\s*\d{1,3}\s*\)$"),
    "date": re.compile(r"^\d{4}-\d{2}-\d{2}$"),
    "datetime": re.compile(
        r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
    ),
    "duration": re.compile(r"^([-+]?(\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d|w))+$"),
    "bsonobjectid": re.compile(r"^[0-9a-fA-F]{24}$"),
}
_FORMAT_RES["date-time"] = _FORMAT_RES["datetime"]


def format_ok(fmt: str, s: str) -> bool:
    """Whether ``s`` is a valid ``fmt`` string; formats we do not know are not checked."""
    rx = _FORMAT_RES.get(fmt)
    if rx is not None:
        if not rx.match(s):
            return False
        if fmt in ("date", "datetime", "date-time"):
            try:
                _dt.date.fromisoformat(s[:10])
            except ValueError:
                return False
        return True
    try:
        if fmt == "ipv4":
            ipaddress.IPv4Address(s)
        elif fmt == "ipv6":
            ipaddress.IPv6Address(s)
        elif fmt == "cidr":
            ipaddress.ip_network(s, strict=False)
        elif fmt == "byte":
            base64.b64decode(s, validate=True)
    except (ValueError, binascii.Error):
        return False
    return True
