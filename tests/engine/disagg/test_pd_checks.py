"""A prefill engine refuses requests it cannot serve correctly, with a message naming why.

A real (offline, in-process) engine plays the prefill side; what a decode engine would send is
built by hand, so each mismatch can be tried on its own. The end-to-end tests run the happy path
and a real KV layout mismatch between processes.
"""

from __future__ import annotations

import dataclasses

import pytest

from ketch.engine.config import EngineConfig
from ketch.engine.disagg.messages import (
    MAX_PD_PROMPT_SCORES,
    PD_PROTOCOL_VERSION,
    PrefillFailed,
    PrefillRequest,
    decode,
    encode,
)
from ketch.engine.disagg.prefill import PrefillSide
from ketch.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    from ketch.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="tiny", block_size=16, kv_cache_memory="16MiB"))


class _Attached:
    attached = True


def _request(engine, **changes) -> PrefillRequest:
    prompt = list(range(5, 45))  # 40 tokens: 3 blocks of 16
    message = PrefillRequest(
        version=PD_PROTOCOL_VERSION,
        request_id="r1",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=8, temperature=0),
        seed=7,
        model=engine.model_fingerprint,
        layout=engine.kv_layout,
        kv_dest="127.0.0.1:1",
        dest_blocks=[4, 5, 6],
        start_block=0,
    )
    return dataclasses.replace(message, **changes)


def _answer(engine, message: PrefillRequest, cache=_Attached) -> PrefillFailed | None:
    replies = []
    side = PrefillSide(engine, lambda identity, reply: replies.append(reply), cache())
    # Through the wire format, as the ROUTER delivers it.
    side.on_request(b"peer", decode(encode(message)))
    if not replies:
        engine.abort_request([message.request_id])
        engine.scheduler.release_held(message.request_id)
        return None
    return replies[0]


def test_a_matching_request_is_taken(engine) -> None:
    assert _answer(engine, _request(engine)) is None


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"version": PD_PROTOCOL_VERSION + 1}, "version mismatch"),
        ({"model": "OtherForCausalLM(layers=80)"}, "model mismatch"),
        ({"dest_blocks": [4, 5]}, "offered 2 blocks from block 0 for a 3-block prompt"),
        ({"start_block": 1, "dest_blocks": [5, 6]}, None),
    ],
    ids=["version", "model", "blocks", "start-block"],
)
def test_mismatches_are_refused_clearly(engine, changes: dict, expected: str | None) -> None:
    answer = _answer(engine, _request(engine, **changes))
    if expected is None:
        assert answer is None
    else:
        assert isinstance(answer, PrefillFailed) and answer.status_code == 400
        assert expected in answer.error


def test_prompt_logprobs_that_could_not_come_back_in_one_frame_are_refused(engine) -> None:
    scored = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=20)
    assert _answer(engine, _request(engine, params=scored)) is None
    long = list(range(5, 5 + MAX_PD_PROMPT_SCORES // 21 + 1))
    answer = _answer(engine, _request(engine, params=scored, prompt_token_ids=long))
    assert isinstance(answer, PrefillFailed) and answer.status_code == 400
    assert "prompt_logprobs=20" in answer.error and str(MAX_PD_PROMPT_SCORES) in answer.error


def test_kv_layout_mismatch_names_the_field(engine) -> None:
    layout = dataclasses.replace(engine.kv_layout, block_size=32)
    answer = _answer(engine, _request(engine, layout=layout))
    assert isinstance(answer, PrefillFailed)
    assert "block_size is 32 on the decode instance, 16 here" in answer.error


def test_kv_cache_dtype_mismatch_names_both_dtypes(engine) -> None:
    """A bfloat16 decode instance and this float32 prefill instance cannot share blocks: refused
    in the flag's words from the dtype of the layout the request carries (the one place the
    decode side states it)."""
    assert engine.runner_config.kv_cache_dtype == "float32"
    bf16_layout = dataclasses.replace(engine.kv_layout, dtype="bfloat16")
    answer = _answer(engine, _request(engine, layout=bf16_layout))
    assert isinstance(answer, PrefillFailed) and answer.status_code == 400
    assert (
        "KV cache dtype mismatch: the decode instance's KV cache holds bfloat16, this prefill "
        "instance's float32" in answer.error
    )
    assert "--kv-cache-dtype" in answer.error


def test_no_cache_manager_is_refused(engine) -> None:
    class Detached:
        attached = False

    answer = _answer(engine, _request(engine), cache=Detached)
    assert isinstance(answer, PrefillFailed) and "no cache manager attached" in answer.error
    assert answer.status_code == 503  # a passing problem of this instance: retry


@pytest.mark.timeout(120)
def test_a_decode_instance_without_its_cache_manager_is_alive_but_not_ready() -> None:
    import httpx
    from serve_harness import running_server

    with running_server("--role", "decode") as server:  # no sidecar started
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        ready = httpx.get(f"{server.url}/ready", timeout=10)
        assert ready.status_code == 503
        assert "cache manager not attached" in " ".join(ready.json()["problems"])


@pytest.mark.timeout(120)
def test_a_decode_instance_takes_only_its_prefill_peers() -> None:
    import httpx
    from serve_harness import running_server

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    with running_server("--role", "decode", "--pd-prefill-peers", "localhost") as server:
        url = f"{server.url}/v1/completions"
        stranger = {"x-ketch-prefill": "10.11.12.13:8004"}
        refused = httpx.post(url, json=body, headers=stranger, timeout=30)
        assert refused.status_code == 403
        assert "10.11.12.13" in refused.text and "--pd-prefill-peers" in refused.text
        # The right host on another port: the entry without a port pins this instance's own
        # pd-comm port (every pod of a service shares it).
        elsewhere = {"x-ketch-prefill": "127.0.0.1:8004"}
        refused = httpx.post(url, json=body, headers=elsewhere, timeout=30)
        assert refused.status_code == 403 and f"localhost:{server.pd_port}" in refused.text
        # A peer that localhost resolves to passes the check; this instance then fails the
        # request for a reason of its own (no cache manager was started for it).
        peer = {
            "x-ketch-prefill": f"127.0.0.1:{server.pd_port}",
            "x-ketch-decode-host": "evil.invalid",  # ignored: the KV goes where config says
        }
        taken = httpx.post(url, json=body, headers=peer, timeout=30)
        assert taken.status_code == 503 and "cache manager" in taken.text


def test_unknown_prefill_peers_cost_at_most_one_dns_lookup_a_second() -> None:
    """Review L2: a forged x-ketch-prefill used to re-resolve --pd-prefill-peers on every
    request (on the executor grammar checks share), so a flood of bad headers became a flood of
    DNS lookups. Now requests naming unknown peers share the next resolution, at most one a
    second; a peer that the names resolve to is still taken."""
    import asyncio
    import time

    from ketch.engine.serving.pairing import PrefillPeers

    peers = PrefillPeers("prefill-peers.ns.svc", 8004)
    lookups: list[float] = []

    def resolve() -> set[tuple[str, int]]:
        lookups.append(time.monotonic())
        time.sleep(0.05)  # a DNS round trip
        return {("10.1.2.3", 8004)}

    peers._resolve = resolve  # type: ignore[method-assign]

    async def flood() -> list[bool]:
        forged = [peers.allows(f"10.9.{i // 200}.{i % 200}", 8004) for i in range(400)]
        return await asyncio.gather(*forged, peers.allows("10.1.2.3", 8004))

    started = time.monotonic()
    *refused, allowed = asyncio.run(flood())
    assert not any(refused) and allowed
    assert len(lookups) <= 2, f"{len(lookups)} DNS lookups for one burst of forged headers"
    assert time.monotonic() - started < 3
    asyncio.run(flood())  # the next burst, right after: waits for the next slot, one lookup
    assert len(lookups) <= 3 and lookups[-1] - lookups[-2] >= 0.9
