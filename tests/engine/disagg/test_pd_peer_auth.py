"""Prefill/decode pods that share a peer key: outputs still equal a mixed instance's, and a
pd-comm message without a valid seal (none, a wrong key, a stale or replayed seal) gets no
answer, even from a peer that got past the connection gate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from cm_harness import SMALL
from pd_harness import Pod, running_pods
from router_harness import Router
from serve_harness import Server
from test_pd_exactness import _complete, _prompts

from ketch.engine.cache_manager.protocol import KVLayout
from ketch.engine.disagg import messages as m
from ketch.engine.disagg.coordinator import FROM_ROUTER, TO_ROUTER
from ketch.engine.peer_auth import PeerAuth, gate_client
from ketch.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

KEY = b"peer-key-of-this-inference-service"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    key_file = tmp_path_factory.mktemp("peer-key") / "key"
    key_file.write_bytes(KEY)
    mixed = Server()
    try:
        with running_pods(("prefill",), ("decode",), peer_key_file=str(key_file)) as pods:
            mixed.wait_ready()
            router = Router("--prefill", pods[0].url, "--decode", pods[1].url)
            try:
                yield {"router": router, "mixed": mixed, "prefill": pods[0], "decode": pods[1]}
            finally:
                router.stop()
    finally:
        mixed.stop()


def test_keyed_disaggregated_outputs_equal_mixed(cluster: dict) -> None:
    prompts = _prompts(num_plain=6)
    before = cluster["decode"].cm_metric("cache_manager_kv_received_bytes_total")
    cases = [(p, stream) for p in prompts for stream in (False, True)]
    with ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda c: _complete(cluster["mixed"].url, *c), cases))
        got = list(pool.map(lambda c: _complete(cluster["router"].url, *c), cases))
    assert got == want
    assert cluster["decode"].cm_metric("cache_manager_kv_received_bytes_total") > before


def _dealer(pod: Pod) -> zmq.Socket:
    """A peer past the connection gate (it presents the key's token, as a decode engine does):
    what it sends still needs a valid, fresh seal. test_pd_comm_gate covers the gate itself."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    gate_client(sock, KEY, TO_ROUTER)
    sock.connect(f"tcp://{pod.pd_address}")
    return sock


def _prefill_request() -> m.PrefillRequest:
    layout = KVLayout(**SMALL)
    return m.PrefillRequest(
        m.PD_PROTOCOL_VERSION, "forged", [5, 6, 7], SamplingParams(max_tokens=2), 0, "tiny",
        layout, "127.0.0.1:1", [1], 0,
    )  # fmt: skip


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_peers_without_the_key_get_no_answer(cluster: dict, role: str) -> None:
    pod: Pod = cluster[role]
    sock = _dealer(pod)
    stale = PeerAuth(KEY, clock=lambda: time.time() - 120)
    for message in (m.PdPing(["x"]), _prefill_request()):
        data = m.encode(message)
        for frames in (
            [data],  # no key at all
            [data, PeerAuth(b"wrong-key-wrong-key").seal(TO_ROUTER, data)],
            [data, PeerAuth(KEY).seal(FROM_ROUTER, data)],  # an answer's seal sent back
            [data, stale.seal(TO_ROUTER, data)],  # captured two minutes ago
        ):
            sock.send_multipart(frames)
            assert not sock.poll(500), f"{role} answered an unauthenticated {frames!r:.80}"
    # With the key a ping is answered, with a sealed answer; the same frames again are a replay.
    ping = m.encode(m.PdPing(["x"]))
    sealed = [ping, PeerAuth(KEY).seal(TO_ROUTER, ping)]
    sock.send_multipart(sealed)
    assert sock.poll(10_000)
    answer, seal = sock.recv_multipart()
    assert PeerAuth(KEY).check(FROM_ROUTER, [answer], seal) is None
    assert m.decode(answer) == m.PdPong(["x"])
    sock.send_multipart(sealed)
    assert not sock.poll(500), "a replayed ping was answered"
    sock.close()
    assert pod.ready() is not None
    assert _complete(cluster["router"].url, "Still serving", False) == _complete(
        cluster["mixed"].url, "Still serving", False
    )
