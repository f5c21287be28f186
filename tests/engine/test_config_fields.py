"""``config.json`` fields Ketch does not implement are refused at load, naming the field
(``ketch.engine.models.architectures``); fields transformers ignores for an architecture are
ignored; a sliding window that never slides is accepted, and the model it loads is exact.

Configs are written by transformers' own config classes, so what is checked is what real
checkpoints hold (defaults, ``layer_types`` as Qwen2/Qwen3 compute them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ketch.engine.errors import ModelLoadError
from ketch.engine.models.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES
from ketch.engine.models.config import ModelConfig

DOCS = Path(__file__).parents[2] / "docs" / "models.md"
SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def hf_config(arch: str, **overrides: Any):
    """A transformers config object of architecture ``arch`` ("MistralForCausalLM", ...)."""
    import transformers

    name = arch.replace("ForCausalLM", "Config")
    cls = getattr(transformers, "Gemma3TextConfig" if name == "Gemma3Config" else name)
    return cls(architectures=[arch], **{**SMALL, **overrides})


def config_dict(arch: str, **overrides: Any) -> dict[str, Any]:
    """What ``save_pretrained`` writes to config.json for that config."""
    return json.loads(hf_config(arch, **overrides).to_json_string())


def load(raw: dict[str, Any], context_len: int | None = None) -> ModelConfig:
    return ModelConfig.from_dict(raw, source="config.json", context_len=context_len)


def refusal(raw: dict[str, Any], context_len: int | None = None) -> str:
    with pytest.raises(ModelLoadError) as caught:
        load(raw, context_len)
    return str(caught.value)


def test_a_mistral_window_shorter_than_the_context_is_refused_naming_sliding_window() -> None:
    message = refusal(config_dict("MistralForCausalLM", sliding_window=64))
    assert "sliding_window=64" in message
    assert "sliding-window attention is not implemented yet" in message
    assert "512 tokens" in message


def test_mistral_windows_that_never_slide_are_accepted() -> None:
    assert load(config_dict("MistralForCausalLM", sliding_window=None))
    assert load(config_dict("MistralForCausalLM", sliding_window=512))
    # transformers' default window (4096) is longer than this model's context
    raw = config_dict("MistralForCausalLM")
    assert raw["sliding_window"] == 4096 and load(raw)
    del raw["sliding_window"]  # left out: MistralConfig's default, 4096, again
    assert load(raw)


def test_the_context_served_decides_whether_a_window_slides() -> None:
    raw = config_dict("MistralForCausalLM", sliding_window=64)
    assert load(raw, context_len=64)
    assert "65 tokens" in refusal(raw, context_len=65)


def test_mistral_v0_1_proportions_are_refused() -> None:
    """Mistral-7B-v0.1: a 4096-token window on a 32768-token context."""
    raw = config_dict("MistralForCausalLM", sliding_window=4096, max_position_embeddings=32768)
    assert "sliding_window=4096" in refusal(raw)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize(
    ("use", "window", "max_window_layers"),
    [
        (True, 64, 0),  # every layer slides
        (True, 64, 2),  # the last layer slides
        (True, 64, 3),  # no layer slides
        (False, 64, 0),  # the window is off
        (True, 512, 0),  # every layer slides, over the whole context: a no-op
        (True, None, 0),
    ],
)
def test_qwen_windows_are_refused_exactly_when_a_layer_slides(
    arch: str, use: bool, window: int | None, max_window_layers: int
) -> None:
    """Refused iff transformers' config has a sliding layer whose window is shorter than the
    context (its own computation of layer_types is the oracle)."""
    settings = dict(
        use_sliding_window=use, sliding_window=window, max_window_layers=max_window_layers
    )
    hf = hf_config(arch, **settings)
    slides = (
        "sliding_attention" in hf.layer_types
        and hf.sliding_window is not None
        and hf.sliding_window < hf.max_position_embeddings
    )
    raw = config_dict(arch, **settings)
    if slides:
        assert re.search(
            r"sliding_window=64 \(use_sliding_window=true, sliding layers", refusal(raw)
        )
    else:
        assert load(raw)
    for key in ("layer_types",):  # a hand-written config.json without it: computed the same
        raw.pop(key, None)
    if slides:
        assert "sliding_window=64" in refusal(raw)
    else:
        assert load(raw)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_other_attention_layer_types_are_refused(arch: str) -> None:
    raw = config_dict(arch)
    raw["layer_types"] = ["full_attention", "linear_attention", "full_attention"]
    assert "layer_types: 'linear_attention' layers are not implemented" in refusal(raw)
    raw["layer_types"] = ["full_attention"] * 3
    assert load(raw)


def test_a_window_declared_to_llama_is_refused_though_transformers_ignores_it() -> None:
    raw = config_dict("LlamaForCausalLM")
    raw.update(sliding_window=64)
    assert "sliding_window=64" in refusal(raw)
    raw.update(use_sliding_window=False)
    assert load(raw)
    raw.update(use_sliding_window=True, sliding_window=512)
    assert load(raw)
    raw = config_dict("MistralForCausalLM")
    raw["layer_types"] = ["sliding_attention"] * 3
    assert "layer_types: 'sliding_attention'" in refusal(raw)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "yarn"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "dynamic",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ],
)
def test_unknown_rope_scaling_types_are_refused_by_name(overrides, named: str) -> None:
    raw = config_dict("LlamaForCausalLM")
    raw.update(overrides)
    message = refusal(raw)
    assert f"rope_parameters.rope_type={named!r}" in message
    assert "default, linear, llama3" in message


def test_a_transformers_4_rope_scaling_is_named_as_written() -> None:
    raw = config_dict("Qwen2ForCausalLM")
    del raw["rope_parameters"]
    raw.update(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0})
    assert "rope_scaling.rope_type='yarn'" in refusal(raw)
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    rope = load(raw).rope
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 2.0, 1e6)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
        (
            "quantization_config",
            {"quant_method": "awq"},
            "quantization_config (quant_method='awq')",
        ),
    ],
)
def test_other_unimplemented_fields_are_named(field: str, value: Any, named: str) -> None:
    for arch in SUPPORTED_ARCHITECTURES:
        raw = config_dict(arch)
        key, name = field, named
        if arch == "Gemma3ForCausalLM" and field == "hidden_act":  # Gemma's name for it
            key, name = "hidden_activation", named.replace("hidden_act", "hidden_activation")
        raw[key] = value
        assert name in refusal(raw), arch


def test_every_problem_is_named_at_once() -> None:
    raw = config_dict("MistralForCausalLM", sliding_window=64, hidden_act="gelu")
    message = refusal(raw)
    assert "hidden_act='gelu'" in message and "sliding_window=64" in message
    assert message.startswith("config.json: MistralForCausalLM: ")


@pytest.mark.parametrize(
    ("arch", "overrides", "biases"),
    [
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, (True, True, True)),
        ("LlamaForCausalLM", {}, (False, False, False)),
        # transformers' Mistral and Qwen2 layers ignore these fields: so does Ketch
        ("MistralForCausalLM", {"attention_bias": True, "mlp_bias": True}, (False, False, False)),
        ("Qwen2ForCausalLM", {"attention_bias": False, "mlp_bias": True}, (True, False, False)),
        ("Qwen3ForCausalLM", {"attention_bias": True, "mlp_bias": True}, (True, True, False)),
        ("Qwen3ForCausalLM", {}, (False, False, False)),
    ],
)
def test_biases_follow_each_architectures_modeling_code(arch, overrides, biases) -> None:
    raw = {**config_dict(arch), **overrides}
    config = load(raw)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == biases
    assert config.qk_norm == (arch == "Qwen3ForCausalLM")


def test_fields_left_out_take_the_config_classes_defaults() -> None:
    raw = config_dict("Qwen3ForCausalLM", head_dim=48)
    assert load(raw).head_dim == 48
    for key in ("head_dim", "num_key_value_heads", "max_position_embeddings"):
        del raw[key]
    raw["num_attention_heads"] = 32
    config = load(raw)  # Qwen3Config's defaults
    assert (config.head_dim, config.num_key_value_heads) == (128, 32)
    assert config.max_position_embeddings == 32768


def test_llama3_original_context_defaults_as_transformers_5() -> None:
    raw = config_dict("LlamaForCausalLM")
    raw["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    assert load(raw).rope.original_max_position_embeddings == 512
    raw["rope_parameters"]["original_max_position_embeddings"] = 64
    assert load(raw).rope.original_max_position_embeddings == 64


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    raw = config_dict("LlamaForCausalLM")
    raw["architectures"] = ["Phi3ForCausalLM"]
    message = refusal(raw)
    assert "unsupported architecture Phi3ForCausalLM" in message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in message


def test_the_supported_list_is_the_table() -> None:
    assert tuple(ARCHITECTURES) == SUPPORTED_ARCHITECTURES
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma3ForCausalLM",
    }


def test_docs_list_every_architecture_and_every_checked_field() -> None:
    text = DOCS.read_text()
    for arch in ARCHITECTURES.values():
        assert f"`{arch.name}`" in text, arch.name
        for rule in arch.rules:
            assert f"`{rule.field}`" in text, (arch.name, rule.field)


def test_a_refused_checkpoint_stops_the_engine_before_loading(tmp_path: Path) -> None:
    """What ``ketch serve`` start-up runs (``LLMEngine``): the error names the field."""
    from ketch.engine import LLM

    hf_config("MistralForCausalLM", sliding_window=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"sliding_window=64: sliding-window attention"):
        LLM(str(tmp_path))


def test_an_accepted_window_serves_transformers_logits(tmp_path: Path) -> None:
    """A Mistral window as long as the context, accepted as full attention, is exact."""
    from test_model_exactness import assert_close
    from test_qwen3 import make_random_checkpoint

    from ketch.kernels import CpuKernels

    path = make_random_checkpoint(
        tmp_path / "mistral", hf_config("MistralForCausalLM", sliding_window=512)
    )
    assert json.loads((path / "config.json").read_text())["sliding_window"] == 512
    assert_close(path, 320, CpuKernels.portable())
