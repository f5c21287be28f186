"""Router settings: instance URLs are plain ``http(s)://host:port`` (nothing a registration
could use to steer requests elsewhere), and the new limits are validated."""

from __future__ import annotations

import pytest

from ketch.engine.router.config import RouterConfig, normalise_url
from ketch.engine.router.registration import TOKEN_ENV, read_registration_token


def test_plain_urls_are_normalised() -> None:
    assert normalise_url("10.0.0.5:8000") == "http://10.0.0.5:8000"
    assert normalise_url("http://Pod-1.svc:80/") == "http://pod-1.svc:80"
    assert normalise_url("https://[::1]:443") == "https://[::1]:443"


@pytest.mark.parametrize(
    "raw",
    [
        "http://h:1/path",
        "http://h:1?q=1",
        "http://h:1?",
        "http://h:1#x",
        "http://u:p@h:1",
        "http://u@h:1",
        "gopher://h:1",
        "http://h:0",
        "http://h",
        "http://h:99999",
        "http://h:1\n",
        "http://h\t:1",
        "http://h h:1",
        "http://hé:1",
        "http://a\\b:1",
        "http://a%2fb:1",
        "http://[fe80::1%25eth0]:1",
        "http://[zz::1]:1",
        "",
    ],
)
def test_urls_with_anything_more_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        normalise_url(raw)


@pytest.mark.parametrize(
    "values",
    [
        {"max_request_bytes": 0},
        {"max_request_bytes": 1.5},
        {"max_request_bytes": True},
        {"body_timeout": 0},
        {"body_timeout": "soon"},
    ],
)
def test_bad_limits_are_refused(values: dict) -> None:
    with pytest.raises(ValueError):
        RouterConfig(mixed="h:1", **values)


def test_registration_token_comes_from_a_file_or_the_environment(tmp_path) -> None:
    off = RouterConfig(mixed="h:1")
    assert read_registration_token(off, {TOKEN_ENV: "x"}) is None
    on = RouterConfig(registration_only=True)
    with pytest.raises(ValueError, match="--registration-token-file"):
        read_registration_token(on, {})
    assert read_registration_token(on, {TOKEN_ENV: " tok \n"}) == "tok"
    with pytest.raises(ValueError, match="printable ASCII"):
        read_registration_token(on, {TOKEN_ENV: "tök"})
    file = tmp_path / "token"
    file.write_text("from-file\n")
    from_file = RouterConfig(registration_only=True, registration_token_file=str(file))
    assert read_registration_token(from_file, {TOKEN_ENV: "ignored"}) == "from-file"
