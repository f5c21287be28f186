"""The engine in its own process, driven over ZMQ by ``EngineClient`` (real processes)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from ketch.engine import LLM, EngineConfig, SamplingParams
from ketch.engine.engine_client import EngineClient, EngineDeadError

CONFIG = dict(block_size=16, kv_cache_memory="64MiB", max_num_seqs=8, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


async def collect(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams):
    tokens, text, reason = [], "", None
    async for delta in client.generate(rid, prompt, params):
        assert delta.error is None, delta.error
        tokens += delta.new_token_ids
        text += delta.new_text
        reason = delta.finish_reason
    return tokens, text, reason


def prompts() -> list[list[int]]:
    llm_tokenizer = LLM("tiny", **CONFIG).tokenizer
    texts = ["Alice was", "The Mouse", "Curiouser and", "Down, down,", "The Rabbit"] * 3
    return [[*llm_tokenizer.encode(t), 7 + i] for i, t in enumerate(texts)]


def test_streams_match_offline_generate(tmp_path: Path) -> None:
    batch = prompts()
    expected = LLM("tiny", **CONFIG).generate(batch, GREEDY)

    async def main() -> list[tuple[list[int], str, str | None]]:
        client = EngineClient(EngineConfig(model="tiny", **CONFIG), port=1, run_dir=tmp_path)
        await client.start()
        try:
            return await asyncio.gather(
                *(collect(client, f"r{i}", p, GREEDY) for i, p in enumerate(batch))
            )
        finally:
            await client.shutdown()

    results = asyncio.run(main())
    for (tokens, text, reason), want in zip(results, expected, strict=True):
        assert tokens == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert reason == "length"
    assert not list(tmp_path.glob("*.sock")), "socket files must be removed on shutdown"


def test_bad_request_is_rejected_and_others_continue(tmp_path: Path) -> None:
    async def main() -> None:
        client = EngineClient(EngineConfig(model="tiny", max_model_len=64, **CONFIG), 2, tmp_path)
        await client.start()
        try:
            bad = client.generate("bad", list(range(1, 100)), GREEDY)
            delta = await anext(bad)
            assert delta.error is not None and "max_model_len" in delta.error
            tokens, _, _ = await collect(client, "good", [5, 6, 7], GREEDY)
            assert len(tokens) == GREEDY.max_tokens
            # A caller that stops reading aborts its request; the engine keeps serving.
            stream = client.generate("early", [5, 6, 7], GREEDY)
            await anext(stream)
            await stream.aclose()
            again, _, _ = await collect(client, "again", [5, 6, 7], GREEDY)
            assert again == tokens
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_killed_engine_fails_open_requests_promptly(tmp_path: Path) -> None:
    async def main() -> None:
        client = EngineClient(EngineConfig(model="tiny", **CONFIG), 3, tmp_path)
        await client.start()
        try:
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            stream = client.generate("doomed", [5, 6, 7], long)
            await anext(stream)
            os.kill(client._process.pid, signal.SIGKILL)
            delta = await asyncio.wait_for(anext(stream), timeout=30)
            while delta.error is None:
                delta = await asyncio.wait_for(anext(stream), timeout=30)
            assert "exited" in delta.error
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                await anext(client.generate("late", [1, 2], GREEDY))
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_start_failure_is_reported(tmp_path: Path) -> None:
    async def main() -> None:
        client = EngineClient(EngineConfig(model=str(tmp_path / "nope")), 4, tmp_path)
        with pytest.raises(RuntimeError, match="nope"):
            await client.start()

    asyncio.run(main())


def test_segments_of_a_killed_engine_are_removed_by_the_server(tmp_path: Path) -> None:
    import socket

    from ketch.engine.worker.shm import shm_names

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        worker_port = sock.getsockname()[1]
    names = [Path("/dev/shm") / n for n in shm_names(worker_port)]

    async def main() -> None:
        client = EngineClient(EngineConfig(model="tiny", **CONFIG), 5, tmp_path, worker_port)
        await client.start()
        try:
            assert all(n.exists() for n in names)
            os.kill(client._process.pid, signal.SIGKILL)
            for _ in range(100):
                if not client.is_alive:
                    break
                await asyncio.sleep(0.1)
            assert not client.is_alive
        finally:
            await client.shutdown()

    asyncio.run(main())
    assert not any(n.exists() for n in names)
