"""``method: draft``: whether the draft checkpoint can draft for the target (no paddle here).

The engine runs these before it starts a worker (``LLMEngine.__init__``), so a draft that could
never work stops ``ketch serve`` at start-up with a ``ValueError`` naming
``speculative_config.model``, instead of failing in the worker or proposing garbage.
"""

from __future__ import annotations

from pathlib import Path

from ketch.engine.models.config import ModelConfig
from ketch.engine.models.paths import resolve_model_path

KEY = "speculative_config.model"


def check_draft_model(
    model: str,
    target_path: Path,
    target: ModelConfig,
    max_model_len: int,
    backend: str = "auto",
    gpu: bool = False,
) -> tuple[Path, ModelConfig]:
    """(the draft's directory, its config), or a ``ValueError`` naming ``KEY`` when it cannot
    draft for ``target`` served at ``max_model_len`` on ``backend``: no checkpoint there, another
    vocabulary size or tokenizer (its token ids would mean other text), a context shorter than
    ``max_model_len`` (refused rather than capped: every request must be able to speculate to
    its end), an architecture the backend does not run, or a GPU device (not built)."""
    if gpu:
        raise ValueError(f"{KEY}: method 'draft' runs on the CPU only (--device cpu)")
    try:
        path = resolve_model_path(model)
        config = ModelConfig.from_dir(path, context_len=max_model_len)
    except ValueError as exc:
        raise ValueError(f"{KEY} {model!r} is not a usable checkpoint: {exc}") from None
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{KEY} {model!r}: {path} has no *.safetensors weights")
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{KEY} {model!r} has vocab_size {config.vocab_size}, the model "
            f"{target.vocab_size}: a draft must share the model's tokenizer"
        )
    problem = _tokenizer_problem(path, target_path)
    if problem is not None:
        raise ValueError(f"{KEY} {model!r}: {problem}: a draft must share the model's tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"{KEY} {model!r} has a context of {config.max_position_embeddings} tokens "
            f"(max_position_embeddings), shorter than max_model_len={max_model_len}: lower "
            "max_model_len or use a draft with a longer context"
        )
    unsupported = config.backend_problem(backend)
    if unsupported is not None:
        raise ValueError(f"{KEY} {model!r}: {unsupported}")
    return path, config


def _tokenizer_problem(draft: Path, target: Path) -> str | None:
    """Why the two directories' tokenizers differ (None: the same vocabulary, added tokens
    included). Compared by vocabulary, not file bytes: the same tokenizer saved by another
    library version is written differently."""
    from ketch.engine.tokenizer import load_tokenizer

    if draft.resolve() == target.resolve():
        return None
    try:
        mine = load_tokenizer(draft)
    except ValueError as exc:
        return f"its tokenizer cannot be loaded ({exc})"
    theirs = load_tokenizer(target)
    a, b = mine.get_vocab(with_added_tokens=True), theirs.get_vocab(with_added_tokens=True)
    if a == b:
        return None
    differ = sorted((set(a.items()) ^ set(b.items())), key=lambda item: item[1])[:3]
    return (
        f"its tokenizer's vocabulary differs from the model's ({len(a)} vs {len(b)} tokens; "
        f"first differences {differ})"
    )
