"""Ketch serving engine: paged-KV, continuous-batching LLM inference on PaddlePaddle.

``LLM`` and friends are imported lazily, so light users of the package (the CLI's argument
parsing, config validation) do not pay for importing paddle.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# paddle warns at import time that ccache (a build cache for custom ops) is missing; that is
# irrelevant to serving and alarming in every log, so it is silenced here.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

_EXPORTS = {
    "LLM": "ketch.engine.llm",
    "CompletionOutput": "ketch.engine.outputs",
    "RequestOutput": "ketch.engine.outputs",
    "EngineConfig": "ketch.engine.config",
    "ModelLoadError": "ketch.engine.errors",
    "SamplingParams": "ketch.engine.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from ketch.engine.config import EngineConfig
    from ketch.engine.errors import ModelLoadError
    from ketch.engine.llm import LLM
    from ketch.engine.outputs import CompletionOutput, RequestOutput
    from ketch.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ketch.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
