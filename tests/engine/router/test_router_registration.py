"""Registration's guard: a token is required (a file or the environment), compared in constant
time; missing or malformed credentials get 401, a wrong token 403; registered URLs are plain
``http(s)://host:port`` with nothing that could steer requests elsewhere.
"""

from __future__ import annotations

import httpx
import pytest
from router_harness import TOKEN_ENV, FakeInstance, raw_exchange, run_router, running_router

TOKEN = "s3cret-token"
GOOD = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.timeout(60)
def test_registration_without_a_token_does_not_start(tmp_path) -> None:
    for flag in ("--registration", "--registration-only"):
        done = run_router("--mixed", "127.0.0.1:1", flag, timeout=30)
        assert done.returncode == 2, done.stderr
        assert "--registration-token-file" in done.stderr and TOKEN_ENV in done.stderr
    empty = tmp_path / "token"
    empty.write_text("\n")
    done = run_router("--registration-only", "--registration-token-file", str(empty))
    assert done.returncode == 2 and "is empty" in done.stderr
    missing = tmp_path / "nothing"
    done = run_router("--registration-only", "--registration-token-file", str(missing))
    assert done.returncode == 2 and "does not exist" in done.stderr


@pytest.mark.timeout(60)
def test_register_needs_the_token(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    fake = FakeInstance()
    try:
        with running_router("--registration-only", "--registration-token-file",
                            str(token_file)) as r:  # fmt: skip
            register = f"{r.url}/v1/ketch/register"
            body = {"url": fake.url, "role": "mixed"}
            cases = {
                None: 401,
                "Basic czNjcmV0": 401,
                "Bearer": 401,
                "Bearer wrong": 403,
                f"Bearer {TOKEN}x": 403,
                f"bearer {TOKEN}": 200,
            }
            for header, status in cases.items():
                headers = {} if header is None else {"Authorization": header}
                reply = httpx.post(register, json=body, headers=headers, timeout=10)
                assert reply.status_code == status, (header, reply.text)
                if status != 200:
                    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
            wrong = httpx.request("DELETE", register, json={"url": fake.url}, timeout=10)
            assert wrong.status_code == 401
            assert fake.url in r.instances()

            # Bytes that are not ASCII in the header: 401, not a 500 from compare_digest.
            raw = (
                b"POST /v1/ketch/register HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                + b"Authorization: Bearer \xc3\xa9t\xe9\r\n\r\n{}"
            )
            assert raw_exchange(r.port, raw).status == 401

            removed = httpx.request("DELETE", register, json={"url": fake.url}, headers=GOOD)
            assert removed.json() == {"removed": True}
    finally:
        fake.stop()


@pytest.mark.timeout(60)
def test_registered_urls_must_be_plain_host_and_port() -> None:
    with running_router("--registration-only", env={TOKEN_ENV: TOKEN}) as r:
        register = f"{r.url}/v1/ketch/register"
        bad = [
            "http://127.0.0.1:8000/v1/steal",
            "http://127.0.0.1:8000?next=http://evil",
            "http://127.0.0.1:8000#frag",
            "http://user:pw@127.0.0.1:8000",
            "http://evil.example@127.0.0.1:8000",
            "ftp://127.0.0.1:8000",
            "file:///etc/passwd",
            "http://127.0.0.1:0",
            "http://127.0.0.1",
            "http://127.0.0.1:8000\n",
            "http://127.0.\t0.1:8000",
            "http://bad host:8000",
            "http://a\\b:8000",
            "http://[zz::1]:8000",
            "",
        ]
        for url in bad:
            reply = httpx.post(register, json={"url": url}, headers=GOOD, timeout=10)
            assert reply.status_code == 400, (url, reply.text)
        for body in ([1], "x", {"url": ["http://127.0.0.1:1"]}, {"url": "127.0.0.1:1", "role": 3}):
            reply = httpx.post(register, json=body, headers=GOOD, timeout=10)
            assert reply.status_code == 400, (body, reply.text)
        nested = b'{"url": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        reply = httpx.post(register, content=nested, headers=GOOD, timeout=10)
        assert reply.status_code in (400, 413), reply.text
        assert r.instances() == {}
        ok = httpx.post(register, json={"url": "127.0.0.1:1"}, headers=GOOD, timeout=10)
        assert ok.status_code == 200 and ok.json()["registered"]["url"] == "http://127.0.0.1:1"
        assert httpx.get(f"{r.url}/health", timeout=5).status_code == 200


@pytest.mark.timeout(60)
def test_instance_listing_is_for_operators_only() -> None:
    """GET /v1/ketch/instances shows backends' addresses and errors: only to the router's admin
    key (written into its run directory) or its registration token. Review M3: a loopback
    client is no longer enough — behind a same-pod proxy or a mesh sidecar every client is."""
    with running_router("--mixed", "127.0.0.1:1") as r:
        listing = f"{r.url}/v1/ketch/instances"
        for headers in ({}, {"X-Forwarded-For": "127.0.0.1"}):
            refused = httpx.get(listing, headers=headers, timeout=10)
            assert refused.status_code == 401 and "admin key" in refused.json()["error"]["message"]
        wrong = httpx.get(listing, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 403
        admin = {"Authorization": f"Bearer {r.admin_key()}"}
        assert httpx.get(listing, headers=admin, timeout=10).status_code == 200
    with running_router("--registration-only", env={TOKEN_ENV: TOKEN}) as r:
        listing = f"{r.url}/v1/ketch/instances"
        assert httpx.get(listing, timeout=10).status_code == 401
        wrong = httpx.get(listing, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 403
        assert httpx.get(listing, headers=GOOD, timeout=10).json()["instances"] == []
