"""Every model class has every member of ``DecoderModel``, and what a backend cannot do it says
(``kept_rows`` None, ``supports_mtp`` False) rather than leaving a caller to ask what it has."""

from __future__ import annotations

import inspect

import pytest

from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.gemma3 import Gemma3Model, NativeGemma3Model
from ketch.engine.models.llama import LlamaModel, weights_nbytes
from ketch.engine.models.llama_gpu import GpuLlamaModel
from ketch.engine.models.llama_native import NativeLlamaModel
from ketch.engine.models.llama_predictor import PredictorLlamaModel
from ketch.engine.models.loader import TINY_MODEL_DIR, load_weights
from ketch.engine.models.protocol import DecoderModel

MODEL_CLASSES = [
    LlamaModel,
    Gemma3Model,
    NativeLlamaModel,
    NativeGemma3Model,
    PredictorLlamaModel,
    GpuLlamaModel,
]
MTP_CAPABLE = {LlamaModel, NativeLlamaModel}


def protocol_members() -> tuple[list[str], list[str]]:
    """(the attributes, the methods) ``DecoderModel`` declares."""
    methods = [n for n, v in vars(DecoderModel).items() if inspect.isfunction(v)]
    methods = [n for n in methods if not n.startswith("_")]
    return list(DecoderModel.__annotations__), methods


@pytest.mark.parametrize("cls", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_every_model_class_has_the_protocol(cls: type) -> None:
    attributes, methods = protocol_members()
    assert set(attributes) == {"backend_name", "supports_mtp"}
    assert set(methods) == {"metadata", "kept_rows", "forward", "weight_bytes"}
    for name in attributes:
        assert name in dir(cls), f"{cls.__name__} lacks {name}"
    for name in methods:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}()"
    assert cls.supports_mtp == (cls in MTP_CAPABLE)


def test_the_eager_model_computes_every_row_and_measures_its_weights() -> None:
    config = ModelConfig.from_dir(TINY_MODEL_DIR)
    weights = load_weights(TINY_MODEL_DIR, config, "float32")
    model = build_model("eager", config, weights, 64, 1)
    spans = [SequenceSpan(0, 3, 3, [1])]
    assert model.backend_name == "eager"
    assert model.kept_rows(spans, [2], None, 16) is None
    assert model.weight_bytes() == weights_nbytes(weights) > 0
