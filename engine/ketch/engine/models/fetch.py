"""``ketch fetch-model``: put a model's weights into a directory before the engine starts.

The operator runs this as an init container for ``hf://`` and ``s3://`` model URIs; the engine
then loads the directory. ``tiny``, ``file://`` and ``pvc://`` models need no fetching (they are in
the image or on a mounted volume). Downloads use the optional ``huggingface_hub`` / ``boto3``
packages (``pip install 'ketch[fetch]'``), imported only when needed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# What the engine reads: config, tokenizer, weights. Everything else (PyTorch .bin shards,
# ONNX exports, images) would only cost download time.
HF_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


class FetchError(RuntimeError):
    pass


def split_uri(uri: str) -> tuple[str, str]:
    if uri == "tiny":
        return "tiny", ""
    if "://" not in uri:
        raise FetchError(
            f"model URI {uri!r} has no scheme; use tiny, file://, pvc://, hf:// or s3://"
        )
    scheme, rest = uri.split("://", 1)
    if scheme not in ("file", "pvc", "hf", "s3") or not rest:
        raise FetchError(f"model URI {uri!r}: unsupported; use tiny, file://, pvc://, hf://, s3://")
    return scheme, rest


def fetch_model(uri: str, dest: str) -> Path:
    """Fetches ``uri`` into ``dest`` (when it needs fetching) and returns the model directory."""
    scheme, rest = split_uri(uri)
    target = Path(dest)
    if scheme in ("tiny", "file", "pvc"):
        logger.info("%s needs no fetching", uri)
        return target
    target.mkdir(parents=True, exist_ok=True)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        logger.info("%s already holds a model; not fetching %s again", target, uri)
        return target
    if scheme == "hf":
        _fetch_hf(rest, target)
    else:
        _fetch_s3(rest, target)
    if not (target / "config.json").is_file():
        raise FetchError(f"{uri} was fetched into {target} but holds no config.json")
    return target


def _fetch_hf(rest: str, target: Path) -> None:
    repo, _, revision = rest.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise FetchError(
            "hf:// models need the huggingface_hub package: pip install 'ketch[fetch]'"
        ) from exc
    logger.info("downloading %s (revision %s) into %s", repo, revision or "main", target)
    try:
        snapshot_download(
            repo_id=repo,
            revision=revision or None,
            local_dir=str(target),
            allow_patterns=HF_PATTERNS,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except Exception as exc:  # network, auth, missing repo: one message for the pod's log
        raise FetchError(f"could not download hf://{rest}: {exc}") from exc


def _fetch_s3(rest: str, target: Path) -> None:
    bucket, _, prefix = rest.partition("/")
    try:
        import boto3
    except ImportError as exc:
        raise FetchError("s3:// models need the boto3 package: pip install 'ketch[fetch]'") from exc
    client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    count = 0
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                relative = item["Key"][len(prefix) :]
                if not relative or relative.endswith("/"):
                    continue
                path = target / relative
                if target.resolve() not in path.resolve().parents:
                    raise FetchError(f"s3 key {item['Key']!r} escapes the target directory")
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(path))
                count += 1
    except FetchError:
        raise
    except Exception as exc:
        raise FetchError(f"could not download s3://{rest}: {exc}") from exc
    if count == 0:
        raise FetchError(f"s3://{rest} holds no objects")
    logger.info("downloaded %d objects from s3://%s into %s", count, rest, target)
