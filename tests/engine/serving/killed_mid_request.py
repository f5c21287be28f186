"""Not collected by the suite (no ``test_`` prefix): ``test_process_hygiene`` runs it in a pytest
of its own and SIGKILLs that pytest while this test holds a server in the middle of a stream."""

from __future__ import annotations

import json
import os
import time

import httpx
from serve_harness import running_server


def test_serving_until_killed() -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "stream": True}
    with running_server() as srv, httpx.stream("POST", f"{srv.url}/v1/completions", json=body):
        marker = os.environ["KETCH_HYGIENE_MARKER"]
        # The parent test reads this file to learn what to look for once this process is gone.
        with open(marker, "w") as out:
            json.dump({"pid": os.getpid(), "worker_port": srv.worker_port}, out)
        time.sleep(600)  # killed here
