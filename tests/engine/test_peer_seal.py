"""peer_auth.PeerAuth and read_peer_key: seals that bind key, channel, every frame and a window."""

from __future__ import annotations

import pytest

from ketch.engine.peer_auth import SEAL_BYTES, PeerAuth, read_peer_key

KEY = b"0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_seal_checks_once_for_its_key_channel_and_frames() -> None:
    clock = Clock()
    seal = PeerAuth(KEY, clock=clock).seal(b"ch", b"head", memoryview(b"data"))
    assert len(seal) == SEAL_BYTES
    assert PeerAuth(b"another-key-1234", clock=clock).check(b"ch", [b"head", b"data"], seal)
    assert PeerAuth(KEY, clock=clock).check(b"other", [b"head", b"data"], seal)
    assert PeerAuth(KEY, clock=clock).check(b"ch", [b"headd", b"ata"], seal)  # lengths count
    assert PeerAuth(KEY, clock=clock).check(b"ch", [b"head", b"data"], seal[:-1])
    receiver = PeerAuth(KEY, clock=clock)
    assert receiver.check(b"ch", [b"head", b"data"], seal) is None
    assert "replayed" in receiver.check(b"ch", [b"head", b"data"], seal)


def test_the_window_refuses_old_and_future_seals_and_forgets_old_nonces() -> None:
    clock = Clock()
    receiver = PeerAuth(KEY, window=30, clock=clock)
    seal = PeerAuth(KEY, clock=clock).seal(b"ch", b"m")
    clock.now += 31
    assert "outside the replay window" in receiver.check(b"ch", [b"m"], seal)
    clock.now -= 62
    assert "outside the replay window" in receiver.check(b"ch", [b"m"], seal)
    clock.now += 31
    for _ in range(3):
        assert receiver.check(b"ch", [b"m"], PeerAuth(KEY, clock=clock).seal(b"ch", b"m")) is None
    clock.now += 61
    receiver.check(b"ch", [b"m"], PeerAuth(KEY, clock=clock).seal(b"ch", b"m"))
    assert len(receiver._seen) == 1  # expired nonces are forgotten


def test_read_peer_key(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KETCH_PEER_KEY", raising=False)
    assert read_peer_key(None) is None
    monkeypatch.setenv("KETCH_PEER_KEY", "from-the-environment")
    assert read_peer_key(None) == b"from-the-environment"
    (tmp_path / "key").write_text(" a-key-of-20-bytes-x\n")
    assert read_peer_key(str(tmp_path / "key")) == b"a-key-of-20-bytes-x"
    (tmp_path / "short").write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        read_peer_key(str(tmp_path / "short"))
    with pytest.raises(ValueError, match="does not exist"):
        read_peer_key(str(tmp_path / "missing"))
