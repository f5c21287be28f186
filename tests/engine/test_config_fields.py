"""``config.json`` fields Ketch does not implement are refused at load, naming the field
(``ketch.engine.models.architectures``); fields transformers ignores for an architecture are
ignored; sliding windows give each layer the window transformers' modeling code applies to it
(``ModelConfig.sliding_windows``; their exactness: test_sliding_window.py), malformed ones are
refused naming the field.

Configs are written by transformers' own config classes, so what is checked is what real
checkpoints hold (defaults, ``layer_types`` as Qwen2/Qwen3 compute them).
"""

from __future__ import annotations

import json
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


def test_a_mistral_window_slides_in_every_layer() -> None:
    assert load(config_dict("MistralForCausalLM", sliding_window=64)).sliding_windows == (64,) * 3
    config = load(config_dict("MistralForCausalLM", sliding_window=64), context_len=32)
    assert config.window(2) == 64 and config.attention_windows == (64,)
    # Mistral-7B-v0.1: a 4096-token window on a 32768-token context
    raw = config_dict("MistralForCausalLM", sliding_window=4096, max_position_embeddings=32768)
    assert load(raw).sliding_windows == (4096,) * 3


def test_a_mistral_window_left_out_is_the_config_classes_default() -> None:
    assert load(config_dict("MistralForCausalLM", sliding_window=None)).sliding_windows == ()
    raw = config_dict("MistralForCausalLM")
    assert raw["sliding_window"] == 4096 and load(raw).sliding_windows == (4096,) * 3
    del raw["sliding_window"]  # left out: MistralConfig's default, 4096, again
    assert load(raw).sliding_windows == (4096,) * 3
    raw["use_sliding_window"] = False  # not a MistralConfig field: ignored, as transformers does
    assert load(raw).sliding_windows == (4096,) * 3


@pytest.mark.parametrize("window", [0, -4, 2.5, "64", True])
def test_a_malformed_window_is_refused_naming_the_field(window: Any) -> None:
    for arch, extra in (
        ("MistralForCausalLM", {}),
        ("Qwen2ForCausalLM", {"use_sliding_window": True}),
        ("Qwen3ForCausalLM", {"use_sliding_window": True}),
        ("Qwen3MoeForCausalLM", {"use_sliding_window": True}),
    ):
        raw = {**config_dict(arch), **extra, "sliding_window": window}
        assert f"sliding_window={window!r}" in refusal(raw), arch
        assert "expected a positive integer or null" in refusal(raw), arch


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize(
    ("use", "window", "max_window_layers"),
    [
        (True, 64, 0),  # every layer slides
        (True, 64, 2),  # the last layer slides
        (True, 64, 3),  # no layer slides
        (False, 64, 0),  # the window is off
        (True, 512, 0),  # every layer slides, over the whole context
        (True, None, 0),
    ],
)
def test_qwen_windows_are_the_layer_types_of_transformers(
    arch: str, use: bool, window: int | None, max_window_layers: int
) -> None:
    """Each layer's window is transformers' config's: its own computation of ``layer_types``
    and ``sliding_window`` is the oracle."""
    settings = dict(
        use_sliding_window=use, sliding_window=window, max_window_layers=max_window_layers
    )
    hf = hf_config(arch, **settings)
    want = [hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types]
    want = tuple(want) if any(want) else ()
    raw = config_dict(arch, **settings)
    assert load(raw).sliding_windows == want
    raw.pop("layer_types", None)  # a hand-written config.json without it: computed the same
    assert load(raw).sliding_windows == want


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_layer_types_are_checked(arch: str) -> None:
    raw = config_dict(arch, use_sliding_window=True, sliding_window=64)
    raw["layer_types"] = ["full_attention", "sliding_attention", "sliding_attention"]
    assert load(raw).sliding_windows == (0, 64, 64)
    raw["layer_types"] = ["sliding_attention"] * 2
    assert "layer_types: 2 entries for 3 layers" in refusal(raw)
    # sliding layers with no window: transformers raises when it builds their mask
    raw = config_dict(arch, use_sliding_window=False)
    raw["layer_types"] = ["full_attention", "sliding_attention", "sliding_attention"]
    raw["sliding_window"] = 64
    message = refusal(raw)
    assert "sliding_attention layers 1-2 without a window (use_sliding_window is false)" in message
    raw.update(use_sliding_window=True, sliding_window=None)
    assert "layers 1-2 without a window (sliding_window is null)" in refusal(raw)
    raw = config_dict(arch, use_sliding_window=True, sliding_window=64)
    del raw["layer_types"]
    raw["max_window_layers"] = "2"
    assert "max_window_layers='2': expected a non-negative integer" in refusal(raw)


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
    assert "sliding_window=64: transformers' LlamaForCausalLM ignores" in refusal(raw)
    assert "65 tokens" in refusal(raw, context_len=65)
    assert load(raw, context_len=64).sliding_windows == ()  # it never slides: full attention
    raw.update(use_sliding_window=False)
    assert load(raw)
    raw.update(use_sliding_window=True, sliding_window=512)
    assert load(raw).sliding_windows == ()
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
    raw["sliding_window"] = 0
    message = refusal(raw)
    assert "hidden_act='gelu'" in message and "sliding_window=0" in message
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
        # ERNIE 4.5: use_bias on every projection (and the MoE's lm_head)
        ("Ernie4_5ForCausalLM", {"use_bias": True}, (True, True, True)),
        ("Ernie4_5_MoeForCausalLM", {"use_bias": True}, (True, True, True)),
        ("Ernie4_5ForCausalLM", {"attention_bias": True, "mlp_bias": True}, (False, False, False)),
    ],
)
def test_biases_follow_each_architectures_modeling_code(arch, overrides, biases) -> None:
    raw = {**config_dict(arch), **overrides}
    config = load(raw)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == biases
    assert config.qk_norm == (arch == "Qwen3ForCausalLM")
    assert config.lm_head_bias == (arch == "Ernie4_5_MoeForCausalLM" and biases[0])


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
        "Ernie4_5ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
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

    hf_config("MistralForCausalLM", hidden_act="gelu").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"hidden_act='gelu': only silu"):
        LLM(str(tmp_path))


def test_an_accepted_window_serves_transformers_logits(tmp_path: Path) -> None:
    """A Mistral window as long as the context (it never slides) is exact."""
    from test_model_exactness import assert_close

    from hf_models import make_random_checkpoint
    from ketch.kernels import CpuKernels

    path = make_random_checkpoint(
        tmp_path / "mistral", hf_config("MistralForCausalLM", sliding_window=512)
    )
    assert json.loads((path / "config.json").read_text())["sliding_window"] == 512
    assert_close(path, 320, CpuKernels.portable())


HOSTILE_CONFIGS = [
    ([1, 2], "expected a JSON object, got list"),
    (None, "expected a JSON object, got NoneType"),
    ({"architectures": "Qwen3ForCausalLM"}, "architectures must be a list of class names"),
    ({"architectures": [5]}, "architectures must be a list of class names"),
    # Per-layer work at load must stay small whatever the file claims.
    ({**SMALL, "architectures": ["MistralForCausalLM"], "num_hidden_layers": 10**9,
      "sliding_window": 16}, "num_hidden_layers=1000000000 is more than Ketch loads"),
    ({**SMALL, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 10**9},
     "num_hidden_layers=1000000000 is more than Ketch loads"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "vocab_size": 10**12},
     "vocab_size=1000000000000 is more than Ketch loads"),
    ({**SMALL, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 8, "max_window_layers": 1, "layer_types": ["sliding_attention", {}, []]},
     "expected a list of layer kinds (strings)"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "rms_norm_eps": "x"}, "rms_norm_eps"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "rms_norm_eps": float("nan")},
     "rms_norm_eps"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "head_dim": "x"}, "head_dim must be"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": -2},
     "num_key_value_heads must be"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "eos_token_id": [1, None]},
     "eos_token_id must be token ids"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "eos_token_id": 10**20},
     "eos_token_id must be a token id"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "eos_token_id": list(range(10**5))},
     "at most 64"),
    ({**SMALL, "architectures": ["LlamaForCausalLM"], "bos_token_id": "<s>"},
     "bos_token_id must be a token id"),
]  # fmt: skip


@pytest.mark.parametrize("raw, words", HOSTILE_CONFIGS)
def test_a_hostile_config_json_is_refused_in_a_short_line(raw: Any, words: str) -> None:
    """Wrong types, extreme sizes and huge lists in config.json: a ModelLoadError naming the
    field (never a TypeError, a MemoryError or a minutes-long load), short whatever it holds."""
    message = refusal(raw)
    assert words in message and len(message) < 600, message


def test_a_config_file_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config_dict("LlamaForCausalLM")))
    (tmp_path / "generation_config.json").write_text("[]")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: expected a JSON object"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text("[" * 100_000)
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        ModelConfig.from_dir(tmp_path)
