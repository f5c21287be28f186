"""Keys from the environment are read like keys from files (review I-2): a Secret value with a
trailing newline is the key without it, and a blank one is a clear error, not "no key"."""

from __future__ import annotations

import pytest

from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.serve import read_admin_key, read_api_key


@pytest.mark.parametrize(("read", "env"), [(read_api_key, "KETCH_API_KEY"),
                                           (read_admin_key, "KETCH_ADMIN_KEY")])  # fmt: skip
def test_environment_keys_are_stripped_and_blank_is_refused(read, env, monkeypatch) -> None:
    monkeypatch.setenv(env, "s3cret\n")
    assert read(ServerConfig()) == "s3cret"
    monkeypatch.setenv(env, " \n")
    with pytest.raises(ValueError, match=f"\\${env} is set but holds only whitespace"):
        read(ServerConfig())
    monkeypatch.delenv(env)
    assert read(ServerConfig()) is None
