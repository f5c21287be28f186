"""Where a model lives: the built-in tiny model or a local checkpoint directory (no paddle)."""

from __future__ import annotations

from pathlib import Path

from ketch.engine.errors import ModelLoadError

TINY_MODEL_DIR = Path(__file__).parent / "tiny"


def resolve_model_path(model: str) -> Path:
    """'tiny' names the built-in model; anything else is a local checkpoint directory."""
    if model == "tiny":
        return TINY_MODEL_DIR
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: give 'tiny' or the path of a local Hugging Face "
            "checkpoint directory (config.json, *.safetensors, tokenizer.json)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model {model!r} is a file; give the checkpoint's directory")
    return path
