"""The installed ``ketch`` console script, run as a user would run it (a subprocess)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ketch.engine import LLM, SamplingParams
from ketch.engine.cli_args import flag_name
from ketch.engine.config import EngineConfig
from ketch.engine.models.loader import TINY_MODEL_DIR
from procs import free_ports

SMALL = ["--block-size", "16", "--kv-cache-memory", "64MiB", "--max-model-len", "128"]


def ketch_script() -> str:
    script = Path(sys.executable).parent / "ketch"
    found = str(script) if script.exists() else shutil.which("ketch")
    assert found, "the ketch console script is not installed (pip install -e .)"
    return found


def ketch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ketch_script(), *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.fixture(scope="module")
def model(checkpoint: Callable[..., Path]) -> str:
    return str(checkpoint("llama"))


def test_generate_prints_prompt_and_completion(model: str, tmp_path: Path) -> None:
    result = ketch("generate", "--max-tokens", "8", "--model", model, *SMALL, "hello", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hello")
    assert len(result.stdout.rstrip("\n")) > len("hello")
    assert "Traceback" not in result.stderr


def test_generate_json_matches_the_library(model: str, tmp_path: Path) -> None:
    prompts = ["hello", "The quick brown fox"]
    result = ketch(
        "generate", "--json", "--max-tokens", "8", "--temperature", "0.8", "--seed", "3",
        "--model", model, *SMALL, *prompts, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == prompts
    for record in records:
        assert isinstance(record["text"], str)
        assert 1 <= len(record["token_ids"]) <= 8
        assert record["finish_reason"] in ("stop", "length")
    # The flags mean what the library's arguments mean: same seed, same tokens.
    llm = LLM(model, block_size=16, kv_cache_memory="64MiB", max_model_len=128)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    expected = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [r["token_ids"] for r in records] == [c.token_ids for c in expected]
    assert [r["text"] for r in records] == [c.text for c in expected]


def test_bad_block_size_is_an_argparse_error(model: str, tmp_path: Path) -> None:
    result = ketch("generate", "--block-size", "17", "--model", model, "hello", cwd=tmp_path)
    assert result.returncode == 2
    assert "--block-size" in result.stderr and "invalid choice" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_missing_model_is_a_one_line_error(tmp_path: Path) -> None:
    result = ketch("generate", "--model", "/nonexistent", "hello", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ketch: error:")]
    assert len(errors) == 1 and "/nonexistent" in errors[0]
    assert result.stdout == ""


def test_help_lists_every_engine_flag_with_its_help(tmp_path: Path) -> None:
    result = ketch("generate", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = "".join(result.stdout.split())  # argparse wraps lines, even inside --flag-names
    for flag in ("--max-num-seqs", "--kv-cache-memory", "--enable-prefix-caching", "--max-tokens"):
        assert flag in text
    assert "--no-enable-prefix-caching" in text
    for field in dataclasses.fields(EngineConfig):
        assert flag_name(field.name) in text
        help_text = "".join(field.metadata["help"].split())
        assert help_text in text, f"no help text for {flag_name(field.name)}"


@pytest.mark.skipif(
    not (TINY_MODEL_DIR / "config.json").exists(),
    reason="the built-in tiny model is not trained yet",
)
def test_generate_with_the_built_in_tiny_model(tmp_path: Path) -> None:
    result = ketch("generate", "The", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The")


@pytest.mark.parametrize(
    "config, named",
    [
        ({"architectures": ["Qwen3ForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0},
            "attn_logit_softcapping",
        ),
        (
            {"architectures": ["Qwen3ForCausalLM"], "quantization_config": {"quant_method": "awq"}},
            "quantization_config (quant_method='awq')",
        ),
        ({"architectures": ["Phi3ForCausalLM"]}, "unsupported architecture Phi3ForCausalLM"),
    ],
)
def test_serve_refuses_an_unimplemented_field_at_start_up(
    tmp_path: Path, config: dict, named: str
) -> None:
    """``ketch serve`` on a checkpoint whose config.json asks for something Ketch does not
    implement exits at start-up with one line naming the field (before it binds a port)."""
    sizes = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": 512}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**sizes, **config}))
    [port] = free_ports(1)
    result = ketch("serve", "--model", str(tmp_path), "--port", str(port), cwd=tmp_path)
    assert result.returncode != 0
    assert named in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
