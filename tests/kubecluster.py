"""The tests' Kubernetes: a real control plane (hack/localcluster) started once per test run.

    kube = start_cluster(tmp_dir)          # etcd, kube-apiserver, controller-manager, scheduler,
                                           # service proxy + DNS, node agent; kube.kubeconfig
    kubectl(kube, "get", "pods", "-A")     # the real kubectl, as the cluster's admin
    kube.get("/api/v1/namespaces").ok()    # the API directly (admin client certificate)
    kube.applied(manager="ketch")          # server-side applies received, from the audit log
    kube.requests(user_agent="kopf", verb="list")   # who asked for what, from the audit log
    kube.restart_apiserver()               # every open watch ends; resuming from an old
                                           # resourceVersion gets the real 410 Gone
    kube.stop()

Nothing here decides an outcome: the API server, its admission and authorization, the
controllers and the scheduler are the upstream programs; what the tests read back (the audit log)
is what the API server wrote. ``KETCH_TEST_KUBECONFIG`` points the tests at another cluster
instead (then the audit-log helpers skip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HACK = Path(__file__).resolve().parents[1] / "hack"
if str(HACK) not in sys.path:
    sys.path.insert(0, str(HACK))

from localcluster import controlplane  # noqa: E402
from localcluster.kubeapi import ApiError, KubeApi  # noqa: E402
from localcluster.layout import Layout  # noqa: E402

__all__ = ["ApiResponse", "KubeCluster", "kubectl", "start_cluster"]

# The kubectl built beside the control plane (same release) comes first on PATH, for the tests
# and every process they start.
_K8S_BIN = (
    controlplane.bin_cache()
    / "k8s"
    / controlplane.module_version("k8s", "k8s.io/kubernetes")
    / "bin"
)
if (_K8S_BIN / "kubectl").exists() and str(_K8S_BIN) not in os.environ.get("PATH", "").split(
    os.pathsep
):
    os.environ["PATH"] = f"{_K8S_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


@dataclass
class ApiResponse:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)

    def ok(self) -> Any:
        """The body, or AssertionError with the Status message when the call failed."""
        if self.status >= 400:
            raise AssertionError(f"HTTP {self.status}: {self.body}")
        return self.body


class KubeCluster:
    """A running cluster: its admin kubeconfig, an admin API client and its audit log."""

    def __init__(self, kubeconfig: str, layout: Layout | None = None):
        self.kubeconfig = kubeconfig
        self.layout = layout
        self.cache_dir = str(Path(kubeconfig).parent / "kubectl-cache")
        self._api = KubeApi(kubeconfig)
        self.url = self._api.server
        self._audit_mark = 0

    # ---- the API, as the admin
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> ApiResponse:
        if params:
            path += ("&" if "?" in path else "?") + urllib.parse.urlencode(params)
        try:
            return ApiResponse(
                200,
                self._api.request(method, path, body, content_type=content_type, timeout=timeout),
            )
        except ApiError as exc:
            try:
                parsed: Any = json.loads(exc.body)
            except ValueError:
                parsed = exc.body
            return ApiResponse(exc.status, parsed)

    def get(self, path: str, **kw: Any) -> ApiResponse:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> ApiResponse:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body: Any, **kw: Any) -> ApiResponse:
        return self.request("PUT", path, body, **kw)

    def patch(self, path: str, body: Any, kind: str = "merge", **kw: Any) -> ApiResponse:
        types = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
            "strategic": "application/strategic-merge-patch+json",
            "apply": "application/apply-patch+yaml",
        }
        return self.request("PATCH", path, body, content_type=types[kind], **kw)

    def delete(self, path: str, **kw: Any) -> ApiResponse:
        return self.request("DELETE", path, **kw)

    def watch(self, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one watch request (``params`` must bound it: ``timeoutSeconds``)."""
        query = urllib.parse.urlencode({**params, "watch": "true"})
        raw = self._api.request(
            "GET", f"{path}?{query}", timeout=float(params.get("timeoutSeconds", 10)) + 10
        )
        text = raw if isinstance(raw, str) else json.dumps(raw)
        for line in text.splitlines():
            if line.strip():
                yield json.loads(line)

    # ---- the audit log: what the API server received, as it wrote it down
    def _audit_events(self, since_mark: bool = False) -> list[dict[str, Any]]:
        if self.layout is None:
            import pytest

            pytest.skip("the audit log is read only on the test run's own cluster")
        path = self.layout.logs / "audit.log"
        with path.open("rb") as f:
            if since_mark:
                f.seek(self._audit_mark)
            data = f.read()
        return [json.loads(line) for line in data.splitlines() if line.strip()]

    def mark(self) -> None:
        """From now on, ``requests(since_mark=True)`` counts only later requests."""
        if self.layout is not None:
            self._audit_mark = (self.layout.logs / "audit.log").stat().st_size

    def requests(
        self,
        *,
        since_mark: bool = True,
        user: str | None = None,
        user_agent: str | None = None,
        verb: str | None = None,
        resource: str | None = None,
        namespace: str | None = None,
        subresource: str | None = "",
    ) -> list[dict[str, Any]]:
        """Audit events (one per request, once answered) matching every filter given.
        ``user_agent`` matches its start (``kopf`` matches ``kopf/1.37``); ``subresource=""``
        (the default) means requests on the object itself, None any."""
        out = []
        for ev in self._audit_events(since_mark):
            if ev.get("stage") != "ResponseComplete":
                continue
            ref = ev.get("objectRef") or {}
            if user is not None and ev.get("user", {}).get("username") != user:
                continue
            if user_agent is not None and not ev.get("userAgent", "").startswith(user_agent):
                continue
            if verb is not None and ev.get("verb") != verb:
                continue
            if resource is not None and ref.get("resource") != resource:
                continue
            if namespace is not None and ref.get("namespace") != namespace:
                continue
            if subresource is not None and ref.get("subresource", "") != subresource:
                continue
            out.append(ev)
        return out

    def applied(self, manager: str | None = None, **filters: str) -> list[dict[str, Any]]:
        """Server-side apply requests (patches with ``force`` set, which only apply takes) the
        API server accepted, oldest first: kind, name, namespace and the body sent."""
        out = []
        for ev in self.requests(since_mark=False, verb="patch"):
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(ev["requestURI"]).query)
            if "force" not in query or ev.get("responseStatus", {}).get("code", 0) >= 300:
                continue
            if manager is not None and query.get("fieldManager") != [manager]:
                continue
            body = ev.get("requestObject") or {}
            ref = ev["objectRef"]
            entry = {
                "kind": body.get("kind"),
                "name": ref.get("name"),
                "namespace": ref.get("namespace", ""),
                "resource": ref.get("resource"),
                "body": body,
            }
            if all(entry.get(k) == v for k, v in filters.items()):
                out.append(entry)
        return out

    # ---- faults a real cluster has
    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again with the same flags: every watch ends, and
        its watch cache starts at etcd's current revision, so a client resuming from an older
        resourceVersion is answered 410 Gone (as after etcd compaction)."""
        if self.layout is None:
            import pytest

            pytest.skip("restarting the API server needs the test run's own cluster")
        controlplane.restart(self.layout.directory, "kube-apiserver")

    def stop(self) -> None:
        self._api.close()
        if self.layout is not None:
            controlplane.stop(self.layout.directory, remove=True)


def _free_index() -> int:
    """An address block (Layout.index) no other cluster on this machine uses."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for index in [*range(50 + os.getpid() % 40, 90), *range(10, 50)]:
        if f" 10.244.{index}.1/" not in used:
            return index
    raise RuntimeError("no free 10.244.N.0/24 block for a test cluster")


def start_cluster(
    directory: Path,
    *,
    watch_pid: int | None = None,
    agent_args: tuple[str, ...] = (),
    node_agent: bool = True,
    service_proxy: bool = True,
) -> KubeCluster:
    """A fresh cluster in ``directory`` for this test run (stopped by ``KubeCluster.stop``, or
    by its watchdog when ``watch_pid`` ends). Without the node agent pods stay Pending."""
    index = _free_index()
    layout = Layout(Path(directory), tag=f"t{index}", index=index)
    started = time.monotonic()
    controlplane.start(
        layout,
        watch_pid=watch_pid,
        agent_args=agent_args,
        node_agent=node_agent,
        service_proxy=service_proxy,
    )
    kube = KubeCluster(str(layout.admin_kubeconfig), layout)
    kube.started_in = time.monotonic() - started  # type: ignore[attr-defined]
    return kube


def kubectl(
    kube: Any, *args: str, input: str | None = None, check: bool = False, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the real kubectl against ``kube`` (text mode; stdout/stderr captured)."""
    cmd = ["kubectl", "--kubeconfig", str(kube.kubeconfig)]
    if getattr(kube, "cache_dir", None):
        cmd += ["--cache-dir", str(kube.cache_dir)]
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    return subprocess.run(
        [*cmd, *args],
        input=input,
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        env=env,
    )


def wait_established(kube: Any, *crds: str, timeout: float = 60) -> None:
    """Waits until each CRD (``crd/<name>``) is Established. Not ``kubectl wait --for
    condition=Established``: that exits with an error ("accessor error: <nil>") instead of waiting
    when it reads a new CRD whose status.conditions is still null (until the API server's naming
    controller has run), so this polls, taking a failed read as "not yet"."""
    query = '-o=jsonpath={.status.conditions[?(@.type=="Established")].status}'
    deadline = time.monotonic() + timeout
    for crd in crds:
        while (got := kubectl(kube, "get", crd, query)).stdout != "True":
            assert time.monotonic() < deadline, f"{crd} not Established: {got.stdout}{got.stderr}"
            time.sleep(0.2)


def stream_events(kube: KubeCluster, path: str, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of one watch request as they arrive (``KubeCluster.watch`` parses them once it
    has ended); ``params`` must bound it: ``timeoutSeconds``."""
    query = urllib.parse.urlencode({**params, "watch": "true"})
    wait = float(params.get("timeoutSeconds", 10)) + 10
    with kube._api.stream("GET", f"{path}?{query}", timeout=wait) as lines:
        for line in lines:
            yield json.loads(line)
