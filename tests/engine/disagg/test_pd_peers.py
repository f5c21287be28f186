"""A decode instance's pd-comm peers and its requests' one deadline, against prefill peers the
test plays (``fake_prefill``: real sockets, each peer behaving one way).

- At most ``MAX_PEERS`` (64) prefill peers at once, counting those a waiting request will open a
  socket to: one more gets 503 and nothing is opened; an idle peer's socket is closed to make
  room; a known peer is still taken.
- A failed peer (silent past ``--pd-peer-timeout``, or one that lost the request) has its socket
  closed as soon as no request uses it.
- ``--pd-request-timeout`` ends a request at whatever stage it is (the peer still working on
  it, or no free KV blocks yet): 504 naming the stage, the peer told to stop, every block free
  again. The peer was given the same deadline (``expires_at``).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_prefill import FakePrefill, FakePrefills, fake_prefills
from pd_harness import Pod, all_blocks_free
from serve_harness import wait_for

from ketch.engine.disagg.coordinator import MAX_PEERS

pytestmark = pytest.mark.timeout(240)

REQUEST_TIMEOUT_S = 12
PEER_TIMEOUT_S = 2
NUM_KV_BLOCKS = MAX_PEERS + 8  # a one-token request holds one block: room for every peer


@pytest.fixture(scope="module")
def decode() -> Iterator[Pod]:
    pod = Pod(
        "decode", "--pd-request-timeout", str(REQUEST_TIMEOUT_S), "--pd-peer-timeout",
        str(PEER_TIMEOUT_S), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-concurrency", "512",
    )  # fmt: skip
    try:
        yield pod.wait_ready()
    finally:
        pod.stop()


@pytest.fixture()
def peers() -> Iterator[FakePrefills]:
    with fake_prefills() as made:
        yield made


def _paired(decode: Pod, peer: FakePrefill, prompt: list[int] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt or [7], "max_tokens": 2, "temperature": 0}
    headers = {"x-ketch-prefill": peer.address}
    return httpx.post(f"{decode.url}/v1/completions", json=body, headers=headers, timeout=60)


def _error(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def test_the_peer_cap_counts_waiting_requests_and_retires_idle_peers(
    decode: Pod, peers: FakePrefills
) -> None:
    idle = peers.add("refuse")
    refused = _paired(decode, idle)
    assert refused.status_code == 400 and "refused by the test's peer" in _error(refused)
    wait_for(lambda: idle.connected >= 1, 10, "the decode instance connected to the idle peer")
    stalls = [peers.add("stall") for _ in range(MAX_PEERS - 1)]  # with the idle one: the cap
    with ThreadPoolExecutor(MAX_PEERS + 4) as pool:
        pending = [pool.submit(_paired, decode, peer) for peer in stalls]
        wait_for(lambda: all(p.requests for p in stalls), 30, "every peer got its request")
        assert idle.disconnected == 0  # unused, but not idle for long: kept
        again = pool.submit(_paired, decode, stalls[0])  # a peer it talks to: still taken
        wait_for(lambda: len(stalls[0].requests) == 2, 20, "the second request to a peer")
        # One more peer: the idle one's socket is closed to make room. Its request finds too
        # few free blocks and waits: no socket yet, but its peer counts.
        newcomer = peers.add("stall")
        starved = pool.submit(_paired, decode, newcomer, list(range(5, 5 + 16 * 20)))
        wait_for(lambda: idle.disconnected >= 1, 20, "the idle peer's socket closed")
        # 64 peers have requests waiting (63 sockets): a 65th is refused, nothing opened to it.
        stranger = peers.add("stall")
        over = _paired(decode, stranger)
        assert over.status_code == 503, over.text
        assert f"already talks to {MAX_PEERS} prefill instances" in _error(over)
        answers = [f.result() for f in [*pending, again]]
        answer_starved = starved.result()
    assert stranger.connected == 0
    for response in answers:
        assert response.status_code == 504, response.text
        assert f"--pd-request-timeout {REQUEST_TIMEOUT_S} s" in _error(response)
        assert "had not handed its KV over" in _error(response)
    # Waiting for blocks counts against the deadline like waiting for the peer. The timed-out
    # requests' blocks come back once their revokes are confirmed (milliseconds, no fixed
    # quarantine), so the starved request usually gets them before its own deadline and reaches
    # its peer, carrying the deadline from its arrival.
    assert answer_starved.status_code == 504, answer_starved.text
    if newcomer.requests:
        ((received, message),) = newcomer.requests
        assert message.expires_at - received < REQUEST_TIMEOUT_S - 1  # it waited for blocks
        assert "had not handed its KV over" in _error(answer_starved)
    else:
        assert "still waiting for free KV blocks" in _error(answer_starved)
        assert newcomer.connected == 0
    # Each peer was given the deadline and was told to stop when it passed.
    for peer in stalls:
        for received, message in peer.requests:
            assert received < message.expires_at <= received + REQUEST_TIMEOUT_S
        wait_for(lambda peer=peer: len(peer.aborts) == len(peer.requests), 10, "AbortPrefill")
    wait_for(lambda: all_blocks_free(decode), 40, "the decode instance's blocks freed", 0.5)


@pytest.mark.parametrize("behaviour", ["silent", "forget"])
def test_a_failed_peer_loses_its_socket(decode: Pod, peers: FakePrefills, behaviour) -> None:
    peer = peers.add(behaviour)
    response = _paired(decode, peer)
    assert response.status_code == 503, response.text
    words = "did not answer" if behaviour == "silent" else "lost the request"
    assert words in _error(response) and peer.address in _error(response)
    wait_for(lambda: peer.disconnected >= 1, 20, "the failed peer's socket closed")
    wait_for(lambda: all_blocks_free(decode), 40, "the decode instance's blocks freed", 0.5)
