"""examples/mixed.yaml with ``engine.tensorParallelSize: 2`` on a CPU role, rendered by the
operator and run as local processes (issue 17, acceptance 3): each engine pod runs two worker
processes, one per rank, and the ``openai`` client through the Service gets exactly the outputs
of the one-rank ``LLM.generate``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from localpods import LocalCluster, localize
from localpods.testing import TIME_SCALE, example, reference_texts

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Alice was beginning to get very tired", "The Queen of Hearts", "Curiouser"]
MAX_TOKENS = 16
SERVICE = "tiny-mixed"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    isvc = localize(example("mixed.yaml"))
    isvc["spec"]["engine"]["tensorParallelSize"] = 2
    isvc["spec"]["roles"]["mixed"]["replicas"] = 1
    running = LocalCluster(isvc, time_scale=TIME_SCALE)
    try:
        running.start().wait_ready()
        yield running
    finally:
        running.stop()
    assert not running.leftover_segments  # the ranks' segments went with the engine


def test_two_ranks_per_pod_answer_exactly(cluster, reference) -> None:
    [pod] = cluster.pods[SERVICE]
    log = pod.container("engine").log(tail=10**7)
    assert "tensor-parallel rank 1 of 2" in log, log[-3000:]  # the second rank's worker
    assert list(Path("/dev/shm").glob("ketch-tp-*")), "no tensor-parallel group segment"
    client = openai.OpenAI(
        base_url=cluster.service_url(SERVICE) + "/v1", api_key="unused", max_retries=0
    )
    want = reference_texts(reference, PROMPTS, MAX_TOKENS)
    for prompt, text in zip(PROMPTS, want, strict=True):
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert got.choices[0].text == text
