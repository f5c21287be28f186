"""Where a model lives: a built-in model (tiny, tiny-copy) or a local checkpoint directory (no
paddle)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ketch.engine.errors import ModelLoadError

TINY_MODEL_DIR = Path(__file__).parent / "tiny"
TINY_COPY_MODEL_DIR = Path(__file__).parent / "tiny_copy"
# Names of the models that ship with Ketch, and their directories.
BUILTIN_MODELS = {"tiny": TINY_MODEL_DIR, "tiny-copy": TINY_COPY_MODEL_DIR}


def resolve_model_path(model: str) -> Path:
    """'tiny' and 'tiny-copy' name built-in models; anything else is a local checkpoint
    directory."""
    if model in BUILTIN_MODELS:
        return BUILTIN_MODELS[model]
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: give 'tiny', 'tiny-copy' or the path of a local "
            "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model {model!r} is a file; give the checkpoint's directory")
    return path


def read_json_object(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, tokenizer_config.json, the safetensors index) that
    must hold an object: a ModelLoadError naming the file when it does not parse or holds
    something else."""
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value
