"""`ketch fetch-model`: what needs no fetch is left alone; failures say what to do."""

from __future__ import annotations

import importlib.util

import pytest

from ketch.engine.cli import main
from ketch.engine.models.fetch import FetchError, fetch_model


@pytest.mark.parametrize("uri", ["tiny", "file:///models/x", "pvc://store/llama"])
def test_local_models_need_no_fetch(uri, tmp_path):
    assert fetch_model(uri, str(tmp_path / "m")) == tmp_path / "m"
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("uri", ["llama", "ftp://x/y", "hf://"])
def test_bad_uris_are_named(uri, tmp_path, capsys):
    with pytest.raises(FetchError, match=r"unsupported|no scheme"):
        fetch_model(uri, str(tmp_path))
    assert main(["fetch-model", uri, str(tmp_path)]) == 1
    assert uri in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="no huggingface_hub"
)
def test_hf_download_failure_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the download must fail cleanly
    with pytest.raises(FetchError, match="could not download hf://org/missing"):
        fetch_model("hf://org/missing@main", str(tmp_path))


def test_an_already_fetched_directory_is_kept(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert fetch_model("hf://org/name", str(tmp_path)) == tmp_path
