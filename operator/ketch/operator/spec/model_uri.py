"""``spec.model.uri`` inside the pod: where the engine finds the weights, and the model name it
serves when ``model.name`` is unset."""

from __future__ import annotations

from ketch.operator.pod_layout import MODEL_MOUNT


def model_path(uri: str) -> str:
    """Where the engine finds the weights inside the pod."""
    if uri == "tiny":
        return "tiny"
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        return rest
    if scheme == "pvc":
        _claim, _, sub = rest.partition("/")
        return f"{MODEL_MOUNT}/{sub}".rstrip("/") if sub else MODEL_MOUNT
    return MODEL_MOUNT  # hf:// and s3:// are fetched there by the model-fetch init container


def default_served_name(uri: str, service_name: str) -> str:
    if uri == "tiny":
        return "tiny"
    tail = uri.rstrip("/").rsplit("/", 1)[-1]
    return tail or service_name
