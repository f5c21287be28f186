"""Ketch serving engine: paged-KV, continuous-batching LLM inference on PaddlePaddle."""

from ketch.engine.config import EngineConfig
from ketch.engine.errors import ModelLoadError
from ketch.engine.llm import LLM
from ketch.engine.outputs import CompletionOutput, RequestOutput
from ketch.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]
