"""The emulator's ``resource.Quantity`` canonicaliser against apimachinery's own test table, and
its use on built-in objects (stored canonical, bad values refused as the server's decoder does);
custom resources keep what was sent."""

from __future__ import annotations

from fractions import Fraction

import pytest
from quantity_cases import BIG, EMIT, INVALID, JSON_VALUES, PARSE, STRING

from kubeemu import Emulator
from kubeemu.quantity import ERR_FORMAT, QuantityError, canonical, format_quantity, parse


def _value(mantissa: int, exponent: int) -> Fraction:
    return mantissa * Fraction(10) ** exponent


@pytest.mark.parametrize(("text", "mantissa", "exponent", "fmt"), PARSE)
def test_parse(text: str, mantissa: int, exponent: int, fmt: str) -> None:
    want = _value(mantissa, exponent)
    for sign, expect in (("", want), ("+", want), ("-", -want)):
        value, got_fmt, _ = parse(sign + text)
        assert (value, got_fmt) == (expect, fmt), sign + text


@pytest.mark.parametrize("text", [*INVALID, ""])
def test_invalid(text: str) -> None:
    with pytest.raises(QuantityError):
        parse(text)


@pytest.mark.parametrize(("mantissa", "exponent", "fmt", "expect", "alternate"), STRING)
def test_string(mantissa: int, exponent: int, fmt: str, expect: str, alternate: str) -> None:
    value = _value(mantissa, exponent)
    assert format_quantity(value, fmt) == expect
    if value:
        assert format_quantity(-value, fmt) == "-" + expect
    assert parse(expect)[2] == expect  # a canonical string is kept as sent
    if alternate:
        assert parse(alternate)[2] is None
        assert canonical(alternate) == expect


@pytest.mark.parametrize(("text", "expect"), EMIT)
def test_emit(text: str, expect: str) -> None:
    assert canonical(text) == expect
    assert canonical("-" + text) == "-" + expect


@pytest.mark.parametrize(("text", "expect"), BIG)
def test_int64_limits(text: str, expect: str) -> None:
    assert canonical(text) == expect


@pytest.mark.parametrize(("raw", "expect"), [*JSON_VALUES, (0.5, "500m"), (2, "2")])
def test_json_values(raw: object, expect: str) -> None:
    assert canonical(raw) == expect


def test_everyday_values() -> None:
    got = {q: canonical(q) for q in ("0.5", "2000m", "1.5Gi", "1024Mi", "0.1Gi", "1e3", "+1")}
    assert got == {
        "0.5": "500m",
        "2000m": "2",
        "1.5Gi": "1536Mi",
        "1024Mi": "1Gi",
        "0.1Gi": "107374182400m",  # a tenth of a GiB is not a whole number of bytes
        "1e3": "1e3",
        "+1": "+1",  # already canonical in the server's eyes: kept as sent
    }


# ----------------------------------------------------------------------------- on the server


def _deployment(name: str, resources: dict, volumes: list | None = None) -> dict:
    pod = {"containers": [{"name": "c", "image": "img:1", "resources": resources}]}
    if volumes is not None:
        pod["volumes"] = volumes
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod},
        },
    }


def test_deployment_stored_canonical(emu: Emulator, namespace: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    resources = {"limits": {"cpu": "0.5", "memory": "1.5Gi"}, "requests": {"cpu": "2000m"}}
    shm = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1024Mi"}}]
    created = emu.post(base, _deployment("q", resources, shm)).ok()
    pod = created["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {
        "limits": {"cpu": "500m", "memory": "1536Mi"},
        "requests": {"cpu": "2"},
    }
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "1Gi"
    stored = emu.get(f"{base}/q").ok()
    assert stored["spec"]["template"]["spec"] == pod


def test_bad_quantity_refused(emu: Emulator, namespace: str) -> None:
    base = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    resp = emu.post(base, _deployment("bad", {"limits": {"cpu": "half"}}))
    assert resp.status == 400
    assert resp.body["message"] == (
        f'Deployment in version "v1" cannot be handled as a Deployment: {ERR_FORMAT}'
    )


def test_hpa_targets_canonical(emu: Emulator, namespace: str) -> None:
    target = {"type": "AverageValue", "averageValue": "0.5"}
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "h"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d"},
            "maxReplicas": 3,
            "metrics": [
                {"type": "Pods", "pods": {"metric": {"name": "m"}, "target": target}},
                {"type": "Resource", "resource": {"name": "memory", "target": {
                    "type": "AverageValue", "averageValue": "2048Mi"}}},
            ],
        },
    }  # fmt: skip
    url = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers"
    metrics = emu.post(url, hpa).ok()["spec"]["metrics"]
    assert metrics[0]["pods"]["target"]["averageValue"] == "500m"
    assert metrics[1]["resource"]["target"]["averageValue"] == "2Gi"
