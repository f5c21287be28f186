"""Every version of the objects a test cares about, as the API server sends them while the test
runs: a watch per path on its own thread, so nothing depends on how long the server's watch
cache keeps history."""

from __future__ import annotations

import json
import threading
import urllib.parse
from typing import Any

from localcluster.kubeapi import KubeApi


class Recorder:
    """``with Recorder(kube, [path, ...], since=rv) as rec:`` watches each collection path from
    resourceVersion ``since`` (or from now) until the block ends; ``rec.events`` holds
    ``(resourceVersion, event)`` of every path, in the order they came."""

    def __init__(self, kube: Any, paths: list[str], since: str | None = None) -> None:
        self.kube = kube
        self.paths = paths
        self.since = since
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._started = threading.Barrier(len(paths) + 1)
        self._threads = [threading.Thread(target=self._watch, args=(p,)) for p in paths]
        self._lock = threading.Lock()

    def __enter__(self) -> Recorder:
        for thread in self._threads:
            thread.start()
        self._started.wait(30)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        assert not self.errors, self.errors

    def sorted(self) -> list[dict[str, Any]]:
        """Every event of every path, by resourceVersion (etcd's revision order)."""
        with self._lock:
            return [ev for _, ev in sorted(self.events, key=lambda item: item[0])]

    def objects(self, name: str) -> list[dict[str, Any]]:
        """Every version of the object called ``name``, oldest first."""
        return [ev["object"] for ev in self.sorted() if ev["object"]["metadata"]["name"] == name]

    def _watch(self, path: str) -> None:
        api = KubeApi(self.kube.kubeconfig)
        since = self.since
        first = True
        try:
            while not self._stop.is_set():
                params = {"watch": "true", "timeoutSeconds": "2", "allowWatchBookmarks": "true"}
                if since:
                    params["resourceVersion"] = since
                url = f"{path}?{urllib.parse.urlencode(params)}"
                with api.stream("GET", url, timeout=10) as lines:
                    if first:
                        first = False
                        self._started.wait(30)
                    for line in lines:
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            self.errors.append(f"{path}: {event['object']}")
                            return
                        since = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            with self._lock:
                                self.events.append((int(since), event))
        except Exception as exc:  # reported by __exit__
            self.errors.append(f"{path}: {type(exc).__name__}: {exc}")
            if first:
                self._started.wait(30)
