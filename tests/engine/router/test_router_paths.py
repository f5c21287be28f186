"""Router paths checked against tiny real HTTP instances: prefill/decode headers, role checks,
retry after a refused connection, a stream that breaks mid-way, and config errors.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from router_harness import FakeInstance, run_router, running_router
from serve_harness import free_ports


@pytest.mark.timeout(60)
def test_prefill_decode_headers_reach_the_decode_instance() -> None:
    prefill = FakeInstance("prefill", pd_comm_port=7777)
    decode = FakeInstance("decode")
    wrong = FakeInstance("decode")  # listed as prefill, says decode: kept out
    try:
        with running_router("--prefill", f"{prefill.url},{wrong.url}", "--decode", decode.url,
                            "--pd-comm-port", "8004") as r:  # fmt: skip
            listed = r.instances()
            assert listed[prefill.url]["healthy"] and listed[decode.url]["healthy"]
            assert not listed[wrong.url]["healthy"]
            assert "role mismatch" in listed[wrong.url]["last_error"]
            assert httpx.get(f"{r.url}/ready", timeout=5).status_code == 200
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
            reply = httpx.post(
                f"{r.url}/v1/completions", json=body, headers={"Authorization": "Bearer k"}
            )
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok"
        assert prefill.requests == [] and wrong.requests == []
        (seen,) = decode.requests
        assert seen["body"] == body  # forwarded unchanged
        assert seen["headers"]["x-ketch-prefill"] == "127.0.0.1:7777"  # from /ready
        assert "x-ketch-decode-host" not in seen["headers"]  # decode knows its own address
        assert seen["headers"]["Authorization"] == "Bearer k"
    finally:
        for fake in (prefill, decode, wrong):
            fake.stop()


@pytest.mark.timeout(60)
def test_embeddings_go_to_one_instance_that_computes_them_alone() -> None:
    """/v1/embeddings samples nothing: no prefill/decode pair, no x-ketch-prefill header; a
    mixed instance first, else a prefill one, else a decode one."""
    prefill = FakeInstance("prefill", pd_comm_port=7777)
    decode = FakeInstance("decode")
    mixed = FakeInstance("mixed")
    running = [prefill, decode, mixed]
    body = {"model": "tiny", "input": ["hello", "world"]}

    def embed(router) -> None:
        reply = httpx.post(f"{router.url}/v1/embeddings", json=body, timeout=20)
        assert reply.status_code == 200, reply.text

    try:
        with running_router("--mixed", mixed.url, "--prefill", prefill.url,
                            "--decode", decode.url) as r:  # fmt: skip
            embed(r)
        assert len(mixed.requests) == 1 and not prefill.requests and not decode.requests
        with running_router("--prefill", prefill.url, "--decode", decode.url) as r:
            embed(r)
            running.remove(prefill)
            prefill.stop()  # its connection is refused: the decode instance computes them
            embed(r)
        for fake in (prefill, decode):
            (seen,) = fake.requests
            assert seen["body"] == body and "x-ketch-prefill" not in seen["headers"]
    finally:
        for fake in running:
            fake.stop()


@pytest.mark.timeout(60)
def test_refused_connection_is_retried_on_another_instance() -> None:
    first, second = FakeInstance(), FakeInstance()
    try:  # no health polls after the first: only the failed request can mark it down
        with running_router("--mixed", f"{first.url},{second.url}", "--policy", "round-robin",
                            "--health-interval", "300") as r:  # fmt: skip
            assert all(i["healthy"] for i in r.instances().values())
            first.stop()
            for _ in range(2):
                reply = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, timeout=20)
                assert reply.status_code == 200
            assert len(second.requests) == 2
            assert not r.instances()[first.url]["healthy"]
            assert r.instances()[first.url]["last_error"]
            assert "ketch_router_upstream_errors_total" in httpx.get(f"{r.url}/metrics").text
    finally:
        second.stop()


@pytest.mark.timeout(60)
def test_stream_broken_midway_ends_with_an_error() -> None:
    fake = FakeInstance(break_stream=True)
    try:
        with running_router("--mixed", fake.url) as r:
            client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=20)
            texts = []
            with pytest.raises(openai.APIError, match="broke off the stream"):
                for chunk in client.completions.create(model="tiny", prompt="x", stream=True):
                    texts.append(chunk.choices[0].text)
            assert texts == ["t0", "t1"]  # what arrived before the break was passed on
    finally:
        fake.stop()


@pytest.mark.timeout(120)
def test_bad_configs_fail_fast_with_clear_errors(tmp_path) -> None:
    cases = {
        (): "no instances",
        ("--mixed", "10.0.0.1:80", "--policy", "random"): "invalid choice",
        ("--mixed", "http://h:notaport"): "bad port",
        ("--prefill", "p.svc"): "need --decode",
        ("--mixed", "h:1", "--engine-port", "70000"): "engine_port must be a port",
    }
    for args, expected in cases.items():
        done = run_router(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert expected in done.stderr, (args, done.stderr)

    unknown = tmp_path / "router.yaml"
    unknown.write_text("port: 9000\nmixd: a:1\n")
    done = run_router("--config", str(unknown))
    assert done.returncode == 2 and "unknown setting(s) ['mixd']" in done.stderr

    with FakeInstanceListening() as busy:
        done = run_router("--mixed", "h:1", "--host", "127.0.0.1", "--port", str(busy))
        assert done.returncode == 2 and f"--port {busy}" in done.stderr


class FakeInstanceListening:
    """A port held busy by a plain listening socket."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        return self.sock.getsockname()[1]

    def __exit__(self, *_: object) -> None:
        self.sock.close()


@pytest.mark.timeout(60)
def test_operator_rendered_config_file_works_unchanged(tmp_path) -> None:
    """The operator's keys (port, policy, prefill, decode, engine_port, pd_comm_port), with
    DNS names: "localhost" and "127.0.0.2" (all of 127/8 is loopback) on one engine_port."""
    (engine_port,) = free_ports(1)
    prefill = FakeInstance("prefill", port=engine_port)
    decode = FakeInstance("decode", host="127.0.0.2", port=engine_port)
    try:
        config = tmp_path / "router.yaml"
        config.write_text(
            "port: 9000\npolicy: prefix-hash\nprefill: localhost\ndecode: 127.0.0.2\n"
            f"engine_port: {engine_port}\npd_comm_port: 8123\n"
        )
        with running_router("--config", str(config)) as r:  # --port overrides the file's
            admin = {"Authorization": f"Bearer {r.admin_key()}"}
            listed = httpx.get(f"{r.url}/v1/ketch/instances", headers=admin).json()
            assert listed["policy"] == "prefix-hash"
            by_url = {i["url"]: i for i in listed["instances"]}
            assert by_url[prefill.url]["role"] == "prefill" and by_url[prefill.url]["healthy"]
            assert by_url[decode.url]["role"] == "decode" and by_url[decode.url]["healthy"]
            assert by_url[decode.url]["source"] == "dns:127.0.0.2"
            reply = httpx.post(f"{r.url}/v1/chat/completions", json={"messages": []})
            assert reply.status_code == 200
        (seen,) = decode.requests
        assert seen["headers"]["x-ketch-prefill"] == "127.0.0.1:8123"  # the configured port
    finally:
        prefill.stop()
        decode.stop()
