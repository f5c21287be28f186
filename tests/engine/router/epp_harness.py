"""Helpers for the endpoint picker tests: a ``ketch router --epp-port`` subprocess and
OpenAI bodies."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import extproc_client
import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families
from router_harness import Router

from procs import free_ports

WAIT_S = 30.0


class EppRouter(Router):
    """A ``ketch router`` with its endpoint picker on a free port (``target``)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        (self.epp_port,) = free_ports(1)
        self.target = f"127.0.0.1:{self.epp_port}"
        super().__init__(*args, "--epp-port", str(self.epp_port), env=env)
        self.channel = grpc.insecure_channel(self.target)
        wait_for(lambda: self.health("liveness") == "SERVING", "gRPC health", self)

    def health(self, service: str) -> str | None:
        try:
            return extproc_client.health(self.channel, service, timeout=2)
        except grpc.RpcError:
            return None

    def pick(self, body: bytes | dict, **kwargs: Any) -> extproc_client.Pick:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        return extproc_client.pick(self.channel, raw, **kwargs)

    def epp_metrics(self) -> dict[str, float]:
        """``ketch:epp_*`` samples by name (with labels appended as ``{k=v}``)."""
        out = {}
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("ketch:epp_"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def stop(self, timeout: float = 20.0) -> int | None:
        self.channel.close()
        return super().stop(timeout)


@contextlib.contextmanager
def epp_router(*args: str) -> Iterator[EppRouter]:
    router = EppRouter(*args)
    try:
        yield router
    finally:
        router.stop()


def wait_for(check: Callable[[], bool], what: str, router: Router | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(
        f"{what} not seen in {WAIT_S:.0f} s" + (f":\n{router.log()}" if router else "")
    )


def address(url: str) -> str:
    """``http://host:port`` -> ``host:port``, as the picker names endpoints."""
    return url.split("://", 1)[1]


def completion(prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, **extra}


def chat(text: str = "hello") -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}]}
