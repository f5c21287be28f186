"""The table of child kinds (ketch.operator.children.KINDS) and what comes from it."""

from __future__ import annotations

import copy

import pytest
from test_builders import UID, example

from ketch.operator import children, handlers, kube
from ketch.operator.children.kind import ChildKind
from ketch.operator.cli import render_object


def test_each_kind_is_listed_once_and_served_by_the_client():
    names = [k.kind for k in children.KINDS]
    assert len(names) == len(set(names))
    for kind in children.KINDS:
        assert kube.RESOURCES[kind.kind] == (kind.api_version, kind.plural)
    watched = {(k.api_version, k.plural) for k in children.WATCHED}
    assert watched | {("v1", "pods")} == set(handlers.WATCHED_RESOURCES)
    assert {k.kind for k in children.UNWATCHED} == {"ScaledObject", "InferencePool", "HTTPRoute"}


def test_an_unwatched_kind_must_say_how_to_find_it_for_pruning():
    with pytest.raises(ValueError, match="unwatched_names"):
        ChildKind(kind="X", api_version="x/v1", plural="xs", build=lambda s, r: [], watched=False)


@pytest.mark.parametrize("name", ["mixed", "disaggregated", "autoscaled", "coordinated"])
def test_build_order_is_stage_order_and_each_child_is_of_a_listed_kind(name):
    body = example(name)
    body["spec"]["gateway"] = {"gatewayRef": {"name": "gw"}}
    built = render_object(copy.deepcopy(body), owner_uid=UID)
    assert [c for stage in children.stages(built) for c in stage] == built
    ranks = [children.BY_KIND[c["kind"]].stage for c in built]
    assert ranks == sorted(ranks)
    assert [c["kind"] for c in built][-2:] == ["InferencePool", "HTTPRoute"]
