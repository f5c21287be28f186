"""``ketch cache-manager`` as the operator runs it: role files, flags, ports, signals."""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from cm_harness import KETCH, CacheManagerProcess, FakeEngine, Segment, free_ports

from ketch.engine.cache_manager.config import CacheManagerConfig, parse_swap_space
from ketch.engine.cache_manager.protocol import KVLayout, Ping
from ketch.engine.cache_manager.swap import SwapStore


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KETCH, "cache-manager", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
    )


@pytest.mark.timeout(60)
def test_serve_role_file_plus_swap_flag_and_sigterm(tmp_path: Path) -> None:
    queue_port, kv_port, http_port, api_port = free_ports(4)
    role = tmp_path / "prefill.yaml"
    role.write_text(
        "model: tiny\nmax_num_seqs: 32\nblock_size: 16\nrole: mixed\n"
        f"port: {api_port}\nhost: 127.0.0.1\ncache_queue_port: {queue_port}\n"
        f"kv_transfer_port: {kv_port}\ncache_manager_port: {http_port}\nswap_space: 1\n"
    )
    # The shape the operator renders; the flag overrides the file's swap_space.
    manager = CacheManagerProcess(
        "--config", str(role), "--swap-space", "64Ki", ports=[queue_port, kv_port, http_port]
    )
    segment = Segment()
    try:
        manager.wait_ready()
        engine = FakeEngine(manager)
        ack = engine.hello(segment)
        assert ack.error is None and ack.swap_slots == 64 * 1024 // segment.layout.block_bytes
        engine.close()
        manager.proc.send_signal(signal.SIGTERM)
        assert manager.proc.wait(15) == 0, manager.log()
    finally:
        manager.stop()
        segment.remove()


@pytest.mark.timeout(60)
def test_bad_settings_exit_2_with_a_clear_message(tmp_path: Path) -> None:
    result = _run("--swap-space", "lots")
    assert result.returncode == 2 and "swap_space='lots' is not a size" in result.stderr
    result = _run("--kv-transfer-port", "8003")
    assert result.returncode == 2 and "ports must be distinct" in result.stderr
    for flag, value, words in (
        ("--max-queued-pushes-per-peer", "0", "max_queued_pushes_per_peer must be a positive"),
        ("--push-threads", "65", "push_threads must be 1-64, got 65"),
        ("--peer-failure-threshold", "0", "peer_failure_threshold must be a positive integer"),
        ("--peer-cooldown", "0", "peer_cooldown must be >= 0.1 seconds"),
    ):
        result = _run(flag, value)
        assert result.returncode == 2 and words in result.stderr, (flag, result.stderr)
    bad = tmp_path / "bad.yaml"
    bad.write_text("swap_spase: 4Gi\n")
    result = _run("--config", str(bad))
    assert result.returncode == 2 and "unknown setting(s) ['swap_spase']" in result.stderr


@pytest.mark.timeout(60)
def test_busy_port_is_named() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        queue_port, http_port = free_ports(2)
        result = _run(
            "--host", "127.0.0.1", "--kv-transfer-port", str(port),
            "--cache-queue-port", str(queue_port), "--cache-manager-port", str(http_port),
            "--role", "decode", "--insecure-no-peer-key",
        )  # fmt: skip
    assert result.returncode == 2
    assert f"--kv-transfer-port {port} on 127.0.0.1 is not free" in result.stderr


@pytest.mark.timeout(60)
def test_health_and_metrics_before_any_engine() -> None:
    manager = CacheManagerProcess("--swap-space", "0").wait_ready()
    try:
        health = manager.health()
        assert health["status"] == "ok" and health["engine_attached"] is False
        assert health["engine_id"] is None and health["swap_slots"] == 0
        samples = manager.metrics()
        for name in (
            "ketch:cache_manager_engine_attached",
            "ketch:cache_manager_swap_total_blocks",
            "ketch:cache_manager_swap_used_blocks",
            "ketch:cache_manager_swap_in_blocks_total",
            "ketch:cache_manager_swap_out_blocks_total",
            "ketch:cache_manager_kv_sent_bytes_total",
            "ketch:cache_manager_kv_received_bytes_total",
            "ketch:cache_manager_kv_transfer_seconds_count",
        ):
            assert (name, ()) in samples, name
        for direction in ("send", "receive"):
            for name in ("kv_transfers_total", "kv_transfer_failures_total"):
                key = ("ketch:cache_manager_" + name, (("direction", direction),))
                assert samples[key] == 0
        for reason in ("queue_full", "circuit_open", "expired"):
            key = ("ketch:cache_manager_push_refusals_total", (("reason", reason),))
            assert samples[key] == 0
        assert samples[("ketch:cache_manager_push_queue_depth", ())] == 0
        assert samples[("ketch:cache_manager_push_circuits_open", ())] == 0
        assert health["pushes"] == {
            "queued": 0, "sending": 0, "destinations": 0, "circuits_open": 0,
            "failing_destinations": {},
        }  # fmt: skip
    finally:
        assert manager.stop() == 0, manager.log()


def test_swap_space_sizes() -> None:
    assert parse_swap_space("4") == parse_swap_space(4) == parse_swap_space("4Gi") == 4 << 30
    assert parse_swap_space("512MiB") == 512 << 20
    assert parse_swap_space("0") == parse_swap_space(0) == 0
    with pytest.raises(ValueError, match="not a size"):
        parse_swap_space("lots")
    with pytest.raises(ValueError, match="cache_manager_port must be a port"):
        CacheManagerConfig(cache_manager_port=70000)


def test_swap_store_checks_everything_before_copying() -> None:
    layout = KVLayout(num_layers=2, kv_heads=1, num_blocks=4, block_size=2, head_dim=2)
    store = SwapStore(layout, 3 * layout.block_bytes)
    assert store.slots == 3
    kv = np.arange(np.prod(layout.shape), dtype=np.float32).reshape(layout.shape)
    original = kv.copy()
    assert "swap slot 3" in store.swap(kv, [(1, 0), (2, 3)], [])
    assert store.used == set() and np.array_equal(kv, original)
    # Outs run before ins: block 1 is evicted to slot 0 and slot 0's old content is not read.
    assert store.swap(kv, [(1, 0)], []) is None
    assert store.swap(kv, [(2, 1)], [(0, 2)]) is None
    assert np.array_equal(kv[:, :, :, 2], original[:, :, :, 1])
    assert store.used == {0, 1}  # slot 0 was read back but still holds block 1
    store.reset()
    assert store.used == set()
    assert "no swap space" in SwapStore(layout, 0).swap(kv, [(1, 0)], [])


@pytest.mark.timeout(60)
def test_silent_engine_is_detached_and_can_say_hello_again() -> None:
    manager = CacheManagerProcess("--swap-space", "1Mi").wait_ready()
    segment = Segment()
    try:
        engine = FakeEngine(manager)
        assert engine.hello(segment).error is None
        deadline = time.monotonic() + 20  # detached after 5 s of silence
        while manager.health()["engine_attached"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert manager.health()["engine_attached"] is False, manager.log()
        engine.send(Ping(engine.engine_id))  # no Pong: the engine must say Hello again
        assert not engine.sock.poll(500)
        assert engine.hello(segment).error is None
        assert manager.health()["engine_attached"] is True
        engine.close()
    finally:
        assert manager.stop() == 0, manager.log()
        segment.remove()
