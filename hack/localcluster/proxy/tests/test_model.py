"""Endpoint selection and object parsing (no network)."""

from __future__ import annotations

import pytest

from localcluster.proxy import model
from localcluster.proxy.proxy import Target


def slice_(endpoints, ports=(("http", 8080),), service="web", address_type="IPv4"):
    return model.parse_slice(
        {
            "metadata": {
                "namespace": "default",
                "name": f"{service}-x",
                "labels": {model.SERVICE_NAME_LABEL: service},
            },
            "addressType": address_type,
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
            "endpoints": endpoints,
        }
    )


def ep(ip, **conditions):
    return {"addresses": [ip], "conditions": conditions}


HTTP = model.Port("http", "TCP", 80)


def test_ready_endpoints_and_target_port():
    s = slice_([ep("10.244.0.5", ready=True), ep("10.244.0.6"), ep("10.244.0.7", ready=False)])
    assert model.backends(HTTP, [s]) == [("10.244.0.5", 8080), ("10.244.0.6", 8080)]
    assert model.backends(model.Port("metrics", "TCP", 9000), [s]) == []  # no such slice port


def test_terminating_serving_endpoints_only_when_none_ready():
    terminating = ep("10.244.0.8", ready=False, serving=True, terminating=True)
    s = slice_([terminating, ep("10.244.0.9", ready=False, serving=False, terminating=True)])
    assert model.backends(HTTP, [s]) == [("10.244.0.8", 8080)]
    assert model.backends(HTTP, [s, slice_([ep("10.244.0.5")])]) == [("10.244.0.5", 8080)]


def test_parse():
    svc = model.parse_service(
        {
            "metadata": {"namespace": "a", "name": "b"},
            "spec": {
                "type": "NodePort",
                "clusterIP": "10.96.0.4",
                "ports": [{"port": 80}],
                "sessionAffinity": "ClientIP",
            },
        }
    )
    assert (svc.cluster_ip, svc.ports, svc.affinity_timeout) == (
        "10.96.0.4",
        (model.Port("", "TCP", 80),),
        10800,
    )
    headless = model.parse_service({"metadata": {"name": "h"}, "spec": {"clusterIP": "None"}})
    assert headless.cluster_ip is None
    assert slice_([], address_type="IPv6") is None
    for bad in (
        {"metadata": {}},
        {"metadata": {"name": "x"}, "spec": {"clusterIP": "banana"}},
        {"metadata": {"name": "x"}, "spec": {"ports": [{"port": 70000}]}},
        {"metadata": {"name": "x"}, "spec": {"ports": "nope"}},
    ):
        with pytest.raises((KeyError, TypeError, ValueError, AttributeError)):
            model.parse_service(bad)


def test_round_robin_and_affinity():
    backends = [("10.244.0.5", 80), ("10.244.0.6", 80)]
    rr = Target("a/b:http", list(backends))
    assert [rr.order("c")[0] for _ in range(4)] == backends * 2
    sticky = Target("a/b:http", list(backends), affinity_timeout=60)
    first = sticky.order("10.0.0.1")[0]
    sticky.used("10.0.0.1", first)
    assert {sticky.order("10.0.0.1")[0] for _ in range(4)} == {first}
    assert Target("a/b:http", []).order("c") == []
