"""What the rendered-pods tests share: the examples, the reference outputs, a stream of client
requests through a Service, and edits of the rendered objects the operator would not make."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIME_SCALE = 0.2  # startup/readiness polling and preStop sleeps 5x faster than the manifests
OK = "ok"

Obj = dict[str, Any]


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def reference_texts(llm, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy ``LLM.generate`` texts: what every served answer must equal."""
    from ketch.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0].text for out in llm.generate(prompts, params)]


def completion(url: str, body: Obj) -> str:
    """One ``/v1/completions`` on a new connection: ``OK``, or what went wrong. A new
    connection per request, as a fresh client makes: keep-alive would pin a client to a pod
    that is going away."""
    fresh = httpx.Limits(max_keepalive_connections=0)
    try:
        with httpx.Client(timeout=60, limits=fresh) as client:
            response = client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code == 200 and (not body.get("stream") or "[DONE]" in response.text):
        return OK
    return f"{response.status_code}: {response.text[:200]}"


class RequestStream:
    """Clients sending completions through a Service, one after another, until the block ends;
    ``results`` holds every outcome. A failed one is retried after a short pause, as a client
    would, and counted each time."""

    RETRY_PAUSE_S = 0.05

    def __init__(self, url: str, streams: tuple[bool, ...] = (False, True, True)) -> None:
        self.url = url
        self.results: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(s,)) for s in streams]

    @property
    def failures(self) -> list[str]:
        return [r for r in self.results if r != OK]

    def __enter__(self) -> RequestStream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def _client(self, stream: bool) -> None:
        body = {"model": "tiny", "prompt": "Alice", "max_tokens": 48, "stream": stream}
        while not self._stop.is_set():
            result = completion(self.url, body)
            self.results.append(result)
            if result != OK:
                time.sleep(self.RETRY_PAUSE_S)


def recreate(children: list[Obj]) -> None:
    """Every Deployment with ``strategy: Recreate`` (a patch for ``LocalCluster.apply``)."""
    for obj in children:
        if obj["kind"] == "Deployment":
            obj["spec"]["strategy"] = {"type": "Recreate"}


def without_pre_stop(children: list[Obj]) -> None:
    """Every container without its ``preStop`` hook: it gets SIGTERM as soon as it is deleted."""
    for obj in children:
        if obj["kind"] == "Deployment":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                container.get("lifecycle", {}).pop("preStop", None)
