"""``check_wiring`` / ``ketch-operator check-wiring``: rendered children vs what ``ketch`` binds.

Real renders of the examples, real parsers and configs; the broken cases edit a rendered manifest
the way a hand-made overlay or a wrong extraArgs would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ketch.engine.cli import build_parser, listening_ports
from ketch.engine.models.architectures import SUPPORTED_ARCHITECTURES
from ketch.operator.cli import render_object
from ketch.operator.wiring import check_wiring

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ("mixed", "disaggregated", "autoscaled", "coordinated")


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


def render(name: str, **spec: dict) -> list[dict]:
    body = example(name)
    for key, value in spec.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value}
    return render_object(body)


def get(children: list[dict], kind: str, name: str) -> dict:
    return next(o for o in children if o["kind"] == kind and o["metadata"]["name"] == name)


def container(children: list[dict], deployment: str, name: str) -> dict:
    pod = get(children, "Deployment", deployment)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def mixed_deployment(children: list[dict]) -> str:
    return next(o["metadata"]["name"] for o in children if o["kind"] == "Deployment")


@pytest.mark.parametrize("name", NAMES)
def test_examples_are_wired(name):
    assert check_wiring(render_object(example(name))) == []


@pytest.mark.parametrize(
    "name, spec",
    [
        ("mixed", {"ports": {"metrics": 9100}}),
        ("disaggregated", {"ports": {"metrics": 9100, "http": 8080, "kvTransfer": 8105}}),
        ("disaggregated", {"ports": {"pdComm": 7004, "cacheManager": 7006}}),
        ("disaggregated", {"engine": {"extraArgs": ["--log-level", "DEBUG"]}}),
        ("mixed", {"cacheManager": {"enabled": False}}),
    ],
)
def test_variations_are_wired(name, spec):
    assert check_wiring(render(name, **spec)) == []


def test_listening_ports_maps_ports_to_flags():
    args = build_parser().parse_args(["serve", "--metrics-port", "9100"])
    ports = listening_ports(args, {"role": "decode", "port": 8080})
    assert ports == {
        8080: "--port",
        9100: "--metrics-port",
        8004: "--pd-comm-port",
    }  # the worker and cache queues are Unix sockets (ketch.engine.rundir), not ports
    assert not ports[8004].loopback and ports[8080].http
    sidecar = listening_ports(build_parser().parse_args(["cache-manager"]), {"role": "decode"})
    assert sidecar == {
        8005: "--kv-transfer-port",
        8006: "--cache-manager-port",
    }
    # A mixed instance's sidecar (the default role) opens no KV transfer port (review L4).
    mixed = listening_ports(build_parser().parse_args(["cache-manager"]), {"role": "mixed"})
    assert mixed == {8006: "--cache-manager-port"}
    with pytest.raises(ValueError, match="ports must be distinct"):
        listening_ports(args, {"port": 9100})


def test_wrong_sidecar_container_port_names_container_flag_and_ports():
    children = render_object(example("disaggregated"))
    sidecar = container(children, "qwen-pd-decode", "cache-manager")
    next(p for p in sidecar["ports"] if p["name"] == "kv-transfer")["containerPort"] = 8015
    [problem] = check_wiring(children)
    for part in (
        "qwen-pd-decode",
        "cache-manager",
        "kv-transfer 8015",
        "8005",
        "--kv-transfer-port",
    ):
        assert part in problem


def test_service_target_port_that_no_container_declares():
    children = render_object(example("disaggregated"))
    peers = get(children, "Service", "qwen-pd-decode-peers")
    next(p for p in peers["spec"]["ports"] if p["name"] == "kv-transfer")["targetPort"] = "kv-xfer"
    [problem] = check_wiring(children)
    assert "service qwen-pd-decode-peers" in problem and "'kv-xfer'" in problem
    assert "cache-manager/kv-transfer 8005" in problem


def test_probe_on_an_undeclared_or_non_http_port():
    children = render_object(example("disaggregated"))
    engine = container(children, "qwen-pd-prefill", "engine")
    engine["readinessProbe"]["httpGet"]["port"] = 8002
    engine["livenessProbe"]["httpGet"]["port"] = "pd-comm"
    container(children, "qwen-pd-prefill", "cache-manager")["startupProbe"]["httpGet"]["port"] = (
        8016
    )
    problems = check_wiring(children)
    assert len(problems) == 3, problems
    [worker_queue] = [p for p in problems if "readinessProbe" in p]
    [not_http] = [p for p in problems if "livenessProbe" in p]
    [undeclared] = [p for p in problems if "startupProbe" in p]
    # The worker queue's number is no port any more (a Unix socket in the run directory).
    assert "container engine" in worker_queue and "8002 is not a declared port" in worker_queue
    assert "--pd-comm-port" in not_http and "not HTTP" in not_http
    assert "container cache-manager" in undeclared and "8016" in undeclared


def test_undeclared_public_port():
    children = render_object(example("disaggregated"))
    engine = container(children, "qwen-pd-decode", "engine")
    engine["ports"] = [p for p in engine["ports"] if p["name"] != "pd-comm"]
    problems = check_wiring(children)
    assert any("service qwen-pd-decode-peers" in p and "'pd-comm'" in p for p in problems)
    [port] = [p for p in problems if p.startswith("deployment")]
    assert "container engine" in port and "8004" in port and "--pd-comm-port" in port
    assert "8002" not in port


def test_unknown_extra_arg_is_reported_with_argparse_message():
    children = render("mixed", engine={"extraArgs": ["--no-such-flag"]})
    [problem] = check_wiring(children)
    assert f"deployment {mixed_deployment(children)}, container engine" in problem
    assert "unrecognized arguments: --no-such-flag" in problem


def test_extra_arg_that_breaks_the_config_is_the_error_ketch_prints():
    children = render_object(example("mixed"))
    container(children, mixed_deployment(children), "engine")["args"] += ["--port", "8005"]
    [problem] = check_wiring(children)
    assert "container engine" in problem and "ports must be distinct; [8005]" in problem


def test_unknown_config_key_in_the_configmap():
    children = render_object(example("disaggregated"))
    config = get(children, "ConfigMap", "qwen-pd-config")
    config["data"]["decode.yaml"] += "no_such_setting: 1\n"
    problems = check_wiring(children)
    assert len(problems) == 2  # the engine and its sidecar both read decode.yaml
    assert all("unknown setting(s) ['no_such_setting']" in p for p in problems)
    assert all("ConfigMap qwen-pd-config key decode.yaml" in p for p in problems)


def test_config_path_missing_from_the_configmap():
    children = render_object(example("mixed"))
    engine = container(children, mixed_deployment(children), "engine")
    engine["args"][1] = "/etc/ketch/other.yaml"
    [problem] = check_wiring(children)
    assert "no key 'other.yaml'" in problem and "container engine" in problem


def test_router_settings_must_match_the_engines():
    children = render_object(example("disaggregated"))
    config = get(children, "ConfigMap", "qwen-pd-config")["data"]
    text = config["router.yaml"].replace("engine_port: 8000", "engine_port: 8080")
    config["router.yaml"] = text.replace("qwen-pd-decode-peers", "qwen-pd-decoder-peers")
    problems = check_wiring(children)
    assert any(
        "'qwen-pd-decoder-peers.default.svc'" in p and "no rendered Service" in p for p in problems
    )
    port = [p for p in problems if "engine_port" in p]
    assert port and all("container router" in p and "8000 (--port)" in p for p in port)


def test_engine_and_sidecar_must_agree_on_the_cache_queue():
    children = render_object(example("mixed"))
    container(children, mixed_deployment(children), "engine")["args"] += [
        "--cache-queue-port",
        "8010",
    ]
    [problem] = check_wiring(children)
    assert "cache_queue_port 8010" in problem and "--cache-queue-port" in problem


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("ketch-operator", path=str(Path(sys.executable).parent))
    return subprocess.run(
        [exe, *args], input=stdin, capture_output=True, text=True, cwd="/tmp", timeout=60
    )


def test_cli_exits_0_when_wired_and_1_with_problems():
    ok = _cli("check-wiring", *(str(EXAMPLES / f"{n}.yaml") for n in NAMES))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.startswith("wiring OK") and len(ok.stdout.splitlines()) == 1
    body = example("mixed")
    body["spec"]["engine"]["extraArgs"] = ["--no-such-flag"]
    bad = _cli("check-wiring", "-n", "prod", "-", stdin=yaml.safe_dump(body))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "--no-such-flag" in bad.stdout and "1 wiring problem" in bad.stderr


def test_cli_checks_a_checkpoint_config_and_names_the_architectures(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    bad = _cli("check-wiring", "--model-config", str(tmp_path / "config.json"),
               str(EXAMPLES / "mixed.yaml"))  # fmt: skip
    assert bad.returncode == 1 and "unsupported architecture BertModel" in bad.stdout, bad.stdout
    missing = _cli("check-wiring", "--model-config", str(tmp_path / "nowhere"),
                   str(EXAMPLES / "mixed.yaml"))  # fmt: skip
    assert missing.returncode == 2 and "has no config.json" in missing.stderr
    helped = _cli("check-wiring", "--help")
    assert all(name in " ".join(helped.stdout.split()) for name in SUPPORTED_ARCHITECTURES)


def test_check_does_not_import_paddle():
    script = (
        "import sys, yaml\n"
        "from ketch.operator.cli import render_object\n"
        "from ketch.operator.wiring import check_wiring\n"
        f"body = yaml.safe_load(open({str(EXAMPLES / 'disaggregated.yaml')!r}))\n"
        "assert check_wiring(render_object(body)) == []\n"
        "assert 'paddle' not in sys.modules, 'the wiring check imported paddle'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd="/tmp", timeout=60
    )
    assert result.returncode == 0, result.stderr
