"""The prefill side holds a request's deadline (``PrefillRequest.expires_at``) at every stage.

A real (offline, in-process) engine plays the prefill instance, as in ``test_pd_checks``: a
request that arrives late is refused; one still waiting in the engine when its deadline passes
is aborted and its blocks freed; one computed after it is not pushed; a push that fails after
it is reported as the deadline's (504). Every answer is the ``PrefillFailed`` the decode peer
would get. (The cache manager's side, abandoning a push mid-way, is in
``tests/engine/cache_manager/test_push_queue.py``; the decode side in ``test_pd_peers.py``.)
"""

from __future__ import annotations

import time

import pytest

from ketch.engine.cache_manager.protocol import PushDone
from ketch.engine.config import EngineConfig
from ketch.engine.disagg.messages import PD_PROTOCOL_VERSION, PrefillFailed, PrefillRequest
from ketch.engine.disagg.prefill import EXPIRY_CHECK_S, PrefillSide
from ketch.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    from ketch.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="tiny", block_size=16, kv_cache_memory="16MiB"))


class _CacheLink:
    """The engine's cache-manager link as the prefill side uses it: attached; records pushes."""

    attached = True

    def __init__(self) -> None:
        self.pushes: list[tuple] = []

    def push(self, *args) -> bool:
        self.pushes.append(args)
        return True


def _request(engine, request_id: str, expires_in: float) -> PrefillRequest:
    return PrefillRequest(
        version=PD_PROTOCOL_VERSION,
        request_id=request_id,
        prompt_token_ids=list(range(5, 45)),  # 3 blocks of 16
        params=SamplingParams(max_tokens=8, temperature=0),
        seed=7,
        model=engine.model_fingerprint,
        layout=engine.kv_layout,
        kv_dest="127.0.0.1:1",
        dest_blocks=[4, 5, 6],
        start_block=0,
        kv_nonce="n" * 32,
        expires_at=time.time() + expires_in,
    )


def _side(engine) -> tuple[PrefillSide, list, _CacheLink]:
    replies: list = []
    cache = _CacheLink()
    return PrefillSide(engine, lambda _, reply: replies.append(reply), cache), replies, cache


def _all_free(engine) -> bool:
    pool = engine.kv_cache.pool
    return not engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_usable_blocks


def test_a_request_that_arrives_after_its_deadline_is_refused(engine) -> None:
    side, replies, _ = _side(engine)
    side.on_request(b"peer", _request(engine, "late", expires_in=-1))
    (answer,) = replies
    assert isinstance(answer, PrefillFailed) and answer.status_code == 504
    assert "deadline passed before it reached" in answer.error
    assert _all_free(engine)


def test_a_request_still_waiting_when_its_deadline_passes_is_aborted(engine) -> None:
    side, replies, cache = _side(engine)
    side.on_request(b"peer", _request(engine, "waiting", expires_in=0.2))
    assert replies == [] and engine.has_unfinished_requests()
    time.sleep(0.2 + EXPIRY_CHECK_S)  # no step ran: it is still queued in the engine
    side.tick()
    (answer,) = replies
    assert isinstance(answer, PrefillFailed) and answer.status_code == 504
    assert "waited or computed" in answer.error
    assert not side.knows("waiting") and cache.pushes == []
    assert _all_free(engine)


def test_a_prompt_computed_after_its_deadline_is_not_pushed(engine) -> None:
    side, replies, cache = _side(engine)
    side.on_request(b"peer", _request(engine, "computed", expires_in=0.3))
    outputs = []
    while not any(o.finished for o in outputs):
        outputs = engine.step()
    time.sleep(0.3)
    side.on_step_outputs(outputs)
    (answer,) = replies
    assert isinstance(answer, PrefillFailed) and answer.status_code == 504
    assert "before its KV could be sent" in answer.error
    assert cache.pushes == []
    assert _all_free(engine)


def test_the_push_carries_the_deadline_and_a_late_failure_says_504(engine) -> None:
    side, replies, cache = _side(engine)
    message = _request(engine, "pushed", expires_in=0.5)
    side.on_request(b"peer", message)
    outputs = []
    while not any(o.finished for o in outputs):
        outputs = engine.step()
    side.on_step_outputs(outputs)
    ((*_, expires_at),) = cache.pushes
    assert expires_at == message.expires_at  # the cache manager holds the same deadline
    assert side.num_pushing == 1 and replies == []
    time.sleep(0.5)
    error = "the request's deadline passed before peer 127.0.0.1:1 acknowledged the push"
    side.on_push_results([PushDone("pushed", False, error=error)])
    (answer,) = replies
    assert isinstance(answer, PrefillFailed) and answer.status_code == 504
    assert error in answer.error
    assert side.num_pushing == 0 and _all_free(engine)


def test_a_push_that_fails_in_time_stays_a_503(engine) -> None:
    side, replies, _ = _side(engine)
    side.on_request(b"peer", _request(engine, "refused", 60))
    outputs = []
    while not any(o.finished for o in outputs):
        outputs = engine.step()
    side.on_step_outputs(outputs)
    side.on_push_results([PushDone("refused", False, error="peer refused the blocks")])
    (answer,) = replies
    assert isinstance(answer, PrefillFailed) and answer.status_code == 503
    assert _all_free(engine)
