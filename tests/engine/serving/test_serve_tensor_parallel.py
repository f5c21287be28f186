"""``ketch serve --tensor-parallel-size 2``: two worker processes, one per rank, behind the same
API; the unmodified ``openai`` client gets exactly what the one-worker engine gives, and losing
either rank fails the instance fast (503, a non-zero exit) with nothing left in /dev/shm."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
from serve_harness import greedy, running_server
from test_structured_outputs import MESSAGES, City

from ketch.engine.worker.shm import group_segment_name, shm_names
from procs import wait_for

PROMPTS = ["Alice was beginning to get very tired", "The rabbit", "Down, down, down"]
MAX_TOKENS = 16


def segments(port: int) -> list[Path]:
    return [Path("/dev/shm") / n for n in (*shm_names(port), group_segment_name(port))]


def test_two_ranks_serve_what_one_worker_serves(reference_llm) -> None:
    with running_server("--tensor-parallel-size", "2") as srv:
        assert len(srv.worker_pids()) == 2
        assert all(p.exists() for p in segments(srv.worker_port))
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        expected = greedy(reference_llm, PROMPTS, MAX_TOKENS)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            got = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert got.choices[0].text == want.text
            stream = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
        # n > 1 with a seed: sampled on rank 0, followed by rank 1, reproducible.
        sampled = [
            client.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=8, n=3, seed=7, temperature=1.0
            )
            for _ in range(2)
        ]
        assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
        # Grammars live on rank 0 only (it samples); the other rank follows its tokens.
        for seed in (None, 3):
            parsed = client.chat.completions.parse(
                model="tiny", messages=MESSAGES, response_format=City, max_tokens=300,
                temperature=0 if seed is None else 1.0, seed=seed,
            )  # fmt: skip
            assert isinstance(parsed.choices[0].message.parsed, City)
        # Embeddings: rank 0 holds the whole final hidden state and answers.
        for pooling in ("last", "mean"):
            got = client.embeddings.create(
                model="tiny", input=PROMPTS, extra_body={"pooling": pooling}
            )
            want = reference_llm.embed(PROMPTS, pooling=pooling)
            for a, b in zip(got.data, want, strict=True):
                assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
        port = srv.worker_port
    assert not any(p.exists() for p in segments(port))


@pytest.mark.parametrize("rank", [0, 1])
def test_killing_either_rank_fails_the_instance_fast(rank: int) -> None:
    with running_server("--tensor-parallel-size", "2") as srv:
        port = srv.worker_port
        os.kill(srv.worker_pids()[rank], signal.SIGKILL)
        seen: list[int] = []

        def unhealthy() -> bool:
            try:
                seen.append(httpx.get(f"{srv.url}/health", timeout=5).status_code)
            except httpx.TransportError:
                return srv.proc.poll() is not None
            return seen[-1] == 503

        wait_for(unhealthy, 15, "/health to turn 503", interval=0.02)
        assert 503 in seen, f"the server exited without /health answering 503: {seen}"
        assert srv.proc.wait(30) != 0, srv.log()
        wait_for(lambda: not any(p.exists() for p in segments(port)), 10, "/dev/shm clean")
