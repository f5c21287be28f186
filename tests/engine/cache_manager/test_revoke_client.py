"""Review M7 on the engine's link to its cache manager: revokes are never silently skipped.

``CacheManagerClient`` against a cache manager played by the test (a ROUTER on the cache queue):
a revoke issued while the link is marked detached is sent once it re-attaches, an unanswered
one is sent again, and ``take_revoked`` names a request only once the cache manager confirmed it
(``Revoked``). Before, ``revoke`` did nothing while detached and nothing was ever confirmed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from cm_harness import SMALL

from ketch.engine import rundir
from ketch.engine.cache_manager import client as client_module
from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.client import CacheManagerClient
from procs import free_ports

pytestmark = pytest.mark.timeout(60)


class Sidecar:
    """The cache manager's end of the cache queue, answering only what the test says."""

    def __init__(self) -> None:
        (self.port,) = free_ports(1)
        self.address = rundir.cache_queue_address(self.port)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.address)
        self.identity: bytes | None = None

    def messages(self, client: CacheManagerClient, seconds: float) -> Iterator[p.Message]:
        """What the engine sends within ``seconds``, ticking it meanwhile."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            client.tick()
            while self.sock.poll(10):
                self.identity, data = self.sock.recv_multipart()
                yield p.decode(data)

    def answer(self, message: p.Message) -> None:
        assert self.identity is not None
        self.sock.send_multipart([self.identity, p.encode(message)])

    def close(self) -> None:
        self.sock.close(linger=0)
        rundir.release(self.address)


@pytest.fixture()
def link(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Sidecar, CacheManagerClient]]:
    monkeypatch.setattr(client_module, "SILENCE_S", 0.5)
    monkeypatch.setattr(client_module, "HELLO_INTERVAL_S", 0.1)
    monkeypatch.setattr(client_module, "REVOKE_RESEND_S", 0.3, raising=False)
    sidecar = Sidecar()
    layout = p.KVLayout(**SMALL, segment="ketch-test-none")
    cache = CacheManagerClient(sidecar.port, layout, lambda _: None, lambda _: None)
    try:
        yield sidecar, cache
    finally:
        cache.close()
        sidecar.close()


def _attach(sidecar: Sidecar, cache: CacheManagerClient, cm_id: str = "cm-1") -> None:
    for message in sidecar.messages(cache, 10):
        if isinstance(message, p.Hello):
            sidecar.answer(p.HelloAck(cm_id, p.PROTOCOL_VERSION, 0))
            break
    until = time.monotonic() + 5
    while not cache.attached and time.monotonic() < until:
        cache.tick()
        time.sleep(0.001)
    assert cache.attached


def _revokes(sidecar: Sidecar, cache: CacheManagerClient, seconds: float) -> list[list[str]]:
    """The Revoke messages the engine sends within ``seconds`` (answering its pings)."""
    found = []
    for message in sidecar.messages(cache, seconds):
        if isinstance(message, p.Ping):
            sidecar.answer(p.Pong("cm-1"))
        elif isinstance(message, p.Revoke):
            found.append(message.request_ids)
    return found


def test_a_revoke_issued_while_detached_is_replayed_on_reattach(link) -> None:
    sidecar, cache = link
    _attach(sidecar, cache)
    for _ in sidecar.messages(cache, 1.0):  # the sidecar goes silent: the engine detaches
        pass
    assert not cache.attached
    cache.revoke(["r1", "r2"])  # a prefill failed meanwhile
    assert cache.take_revoked() == []
    _attach(sidecar, cache)  # the same sidecar answers again
    replayed = _revokes(sidecar, cache, 0.2)
    assert replayed and replayed[0] == ["r1", "r2"], replayed
    assert cache.take_revoked() == []  # not confirmed yet: the blocks stay held
    sidecar.answer(p.Revoked(["r1", "r2"]))
    for _ in sidecar.messages(cache, 0.1):
        pass
    assert cache.take_revoked() == ["r1", "r2"]
    assert cache.take_revoked() == []
    assert _revokes(sidecar, cache, 0.5) == []  # confirmed: never sent again


def test_an_unanswered_revoke_is_sent_again_until_confirmed(link) -> None:
    sidecar, cache = link
    _attach(sidecar, cache)
    cache.revoke(["r3"])
    sent = _revokes(sidecar, cache, 0.8)
    assert sent[:2] == [["r3"], ["r3"]], sent  # at once, then again (REVOKE_RESEND_S)
    sidecar.answer(p.Revoked(["r3"]))
    for _ in sidecar.messages(cache, 0.1):
        pass
    assert cache.take_revoked() == ["r3"]


def test_a_revoke_lost_with_a_restarted_sidecar_goes_to_the_new_one(link) -> None:
    """The sidecar restarted (a Pong with another id): the engine says Hello to the new one
    and sends it the revokes the old one never confirmed."""
    sidecar, cache = link
    _attach(sidecar, cache)
    cache.revoke(["r4"])
    assert _revokes(sidecar, cache, 0.1) == [["r4"]]
    for message in sidecar.messages(cache, 2.0):
        if isinstance(message, p.Ping):
            sidecar.answer(p.Pong("cm-2"))  # a new cache manager answers
            break
    for _ in sidecar.messages(cache, 0.1):
        pass
    assert not cache.attached
    _attach(sidecar, cache, "cm-2")
    assert ["r4"] in _revokes(sidecar, cache, 0.2)
