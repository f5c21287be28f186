"""The Grafana dashboards in charts/ketch/dashboards are well-formed, and every metric name they
query is one a Ketch component exports.

The real-Prometheus check (every query returns data from real pods) is test_dashboards_real.py.
"""

from __future__ import annotations

import re
from typing import Any

import dashboards as dash
import pytest
import yaml
from prometheus_client import CollectorRegistry

from ketch.engine.cache_manager.metrics import CacheManagerMetrics
from ketch.engine.metrics import EngineMetrics
from ketch.engine.router.epp import EppMetrics
from ketch.engine.router.metrics import RouterMetrics
from ketch.engine.stats import EngineSnapshot
from ketch.operator.metrics import OperatorMetrics
from localcluster import metrics as monitoring

BOARDS = dash.load()
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name a registry can expose, labelled families without children included."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count"),
    }
    names = set()
    for family in registry.collect():
        names |= {s.name for s in family.samples}
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def all_exported() -> set[str]:
    engine = EngineMetrics("m")
    engine.set_model("float32", "none", "float32", 1)
    engine.set_block_size(16)
    engine.update(EngineSnapshot(0, 0, 0.0, 10, 10, 0, 4, 0, 0, 0))  # blocks known
    names = exported_names(engine.registry)
    router = RouterMetrics()
    EppMetrics(router.registry)  # as `ketch router --epp-port` adds them
    for registry in (router.registry, CacheManagerMetrics().registry, OperatorMetrics().registry):
        names |= exported_names(registry)
    return names


def test_the_four_dashboards_are_there():
    assert set(BOARDS) == dash.EXPECTED


def test_uids_and_titles_are_unique_and_set():
    uids = [b["uid"] for b in BOARDS.values()]
    titles = [b["title"] for b in BOARDS.values()]
    assert len(set(uids)) == len(uids) == 4
    assert len(set(titles)) == len(titles)
    for board in BOARDS.values():
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", board["uid"])  # Grafana's uid limits
        assert board["title"].startswith("Ketch / ")
        assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
        assert "ketch" in board["tags"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_panel_has_a_datasource_targets_and_a_sane_place(name: str):
    board = BOARDS[name]
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert grid["w"] >= 1 and grid["h"] >= 1 and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE
            assert target["expr"].strip()


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_variables_are_defined_and_every_use_resolves(name: str):
    board = BOARDS[name]
    variables = dash.variables(board)
    assert variables[0]["name"] == "datasource" and variables[0]["query"] == "prometheus"
    values = {v["name"]: "x" for v in variables}
    for variable in variables[1:]:
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        selector, label = dash.label_values_query(variable)
        assert dash.metric_names(dash.substitute(selector, values))
        assert label in ("namespace", "pod", "job"), label
    for target in dash.targets({name: board}):
        dash.substitute(target.expr, values)  # KeyError on an undefined variable


def test_every_queried_name_is_exported_by_a_component():
    exported = all_exported()
    used: dict[str, list[str]] = {}
    for target in dash.targets(BOARDS):
        names = dash.metric_names(target.expr)
        assert names, target
        for metric in names:
            used.setdefault(metric, []).append(str(target))
    unknown = {m: where for m, where in used.items() if m not in exported}
    assert not unknown, unknown
    # The EPP's series are queried, on the router dashboard only.
    assert set(used) >= dash.EPP_SERIES
    for metric in dash.EPP_SERIES:
        assert all(w.startswith("router.json") for w in used[metric])


def test_the_gaie_protocol_gauges_have_a_panel():
    used = {m for t in dash.targets(BOARDS) for m in dash.metric_names(t.expr)}
    gaie = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:cache_config_info")
    assert set(gaie) <= used


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("rate(a_total[5m])", {"a_total"}),
        ('sum by (pod) (ketch:x{pod=~"a-(b|c)", ns="by (x)"})', {"ketch:x"}),
        ("histogram_quantile(0.99, sum by (le) (rate(h_bucket{a='b'}[$__rate_interval])))",
         {"h_bucket"}),
        ("a / on (pod) group_left (role) b + 1e3 and inf", {"a", "b"}),
        ('{__name__="x"}', set()),  # only by Prometheus' parser (ast_names)
    ],
)  # fmt: skip
def test_the_tokenizer_finds_names_and_only_names(expr: str, names: set[str]):
    assert dash.metric_names(expr) == names


def test_substitute_fills_every_syntax_and_refuses_unknown_variables():
    expr = 'x{a="$a", b="${b}", c="[[c]]"}[$__rate_interval]'
    assert dash.substitute(expr, {"a": "1", "b": "2", "c": "3"}) == 'x{a="1", b="2", c="3"}[1m]'
    with pytest.raises(KeyError, match="nope"):
        dash.substitute('x{a="$nope"}', {})


def test_ast_names_reads_prometheus_parse_trees():
    tree: dict[str, Any] = {
        "type": "call",
        "args": [
            {"type": "matrixSelector", "name": "a_total", "matchers": []},
            {
                "type": "vectorSelector",
                "name": "",
                "matchers": [{"name": "__name__", "value": "b"}],
            },
        ],
    }
    assert dash.ast_names(tree) == {"a_total", "b"}


# --------------------------------------------------------------------------- the test's scrape jobs

ADAPTER_VALUES = "rules:\n  custom:\n    - seriesQuery: 'x'\n"


def prometheus_config(*jobs: dict[str, Any]) -> dict[str, Any]:
    settings = monitoring.MonitoringSettings(
        scrape_interval="3s", adapter_values=ADAPTER_VALUES, extra_scrape_configs=jobs
    )
    [config_map] = [
        o for o in monitoring.render(settings) if o["metadata"]["name"] == "prometheus-config"
    ]
    return yaml.safe_load(config_map["data"]["prometheus.yml"])


def test_extra_scrape_jobs_follow_the_annotation_job():
    job = {"job_name": "extra", "static_configs": [{"targets": ["10.0.0.1:8080"]}]}
    config = prometheus_config(job)
    assert [j["job_name"] for j in config["scrape_configs"]] == ["kubernetes-pods", "extra"]
    assert config["scrape_configs"][1] == job
    assert config["global"]["scrape_interval"] == "3s"
    plain = prometheus_config()
    assert [j["job_name"] for j in plain["scrape_configs"]] == ["kubernetes-pods"]


@pytest.mark.parametrize(
    "job",
    [{"job_name": "kubernetes-pods"}, {"static_configs": []}, {"job_name": 7}, "extra", None],
)
def test_bad_extra_scrape_jobs_are_refused(job: Any):
    with pytest.raises(ValueError, match="job"):
        prometheus_config(job)
