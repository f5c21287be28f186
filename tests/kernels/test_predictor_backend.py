"""The predictor backend: its programs against their eager selves, the export cache, the switch.

Each program of ``dense_graph`` called eagerly is plain dygraph paddle (the reference); the
exported program on the inference predictor must agree with it at every token count without
re-exporting, and feed each layer's own weights (one middle program serves them all).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import paddle
import pytest

from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama import LlamaModel
from ketch.engine.models.loader import TINY_MODEL_DIR, load_weights
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.model_runner import configure_paddle
from ketch.kernels import CpuKernels, dense_graph, predictor_backend
from ketch.kernels.dense_graph import DenseShape
from ketch.kernels.linear import ENV, Linear
from ketch.kernels.predictor_backend import DensePrograms, export_programs, program_key

SHAPE = DenseShape(
    hidden=48,
    heads=4,
    kv_heads=2,
    head_dim=12,
    intermediate=40,
    vocab=50,
    eps=1e-6,
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
)


def _random_inputs(kind: str, tokens: int, rng: np.random.Generator) -> list:
    args: list = []
    for spec in dense_graph.input_specs(SHAPE, kind):
        if isinstance(spec, list):
            args.append([_tensor(s, tokens, rng) for s in spec])
        else:
            args.append(_tensor(spec, tokens, rng))
    return args


def _tensor(spec, tokens: int, rng: np.random.Generator) -> paddle.Tensor:
    shape = [tokens if d in (-1, None) else d for d in spec.shape]
    if spec.name in ("input_ids", "logit_rows"):
        high = SHAPE.vocab if spec.name == "input_ids" else tokens
        return paddle.to_tensor(rng.integers(0, high, shape).astype(np.int64))
    return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32) * 0.5)


def _flat(args: list) -> list[paddle.Tensor]:
    return [t for a in args for t in (a if isinstance(a, list) else [a])]


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> DensePrograms:
    configure_paddle(1)
    return DensePrograms(SHAPE, threads=1, root=tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_programs_match_their_eager_reference(programs: DensePrograms, kind: str) -> None:
    rng = np.random.default_rng(0)
    reference = dense_graph.PROGRAMS[kind](SHAPE)
    for tokens in (1, 2, 7, 64, 3):  # sizes in any order, one export
        for _ in range(2):  # fresh weights each call: nothing may be kept from the last one
            args = _random_inputs(kind, tokens, rng)
            want = reference(*args)
            want = want if isinstance(want, tuple) else (want,)
            got = programs.run(kind, _flat(args))
            for a, b in zip(got, want, strict=True):
                a, b = a.numpy(), b.numpy()
                assert a.shape == b.shape
                assert np.abs(a - b).max() <= 1e-5 * max(np.abs(b).max(), 1.0)


def test_export_is_cached_by_shape_and_code(tmp_path, monkeypatch) -> None:
    first = export_programs(SHAPE, tmp_path)
    assert {p.name for p in first.iterdir()} >= {"first.json", "middle.json", "last.json", "done"}
    monkeypatch.setattr(paddle.jit, "save", lambda *a, **k: pytest.fail("exported again"))
    assert export_programs(SHAPE, tmp_path) == first
    other = DenseShape(**{**SHAPE.as_dict(), "intermediate": 44})
    assert program_key(other) != program_key(SHAPE)
    assert not list(tmp_path.glob("programs/.export-*"))  # no scratch left behind


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(predictor_backend.ENV_CACHE_DIR, str(tmp_path))
    assert export_programs(SHAPE).parent == tmp_path / "programs"


def _tiny_step(model, cache: KVCache, config: ModelConfig, tokens: int = 9) -> np.ndarray:
    meta = model.metadata([SequenceSpan(0, tokens, tokens, [1])], 16, cache.num_blocks)
    with paddle.no_grad():
        return model.forward(
            paddle.to_tensor(np.arange(1, tokens + 1, dtype=np.int64)),
            paddle.to_tensor(np.arange(tokens, dtype=np.int64)),
            cache.layers,
            meta,
            paddle.to_tensor(np.array([tokens - 1], dtype=np.int64)),
        ).numpy()


@pytest.mark.parametrize("kernels", ["selected", "portable"])
def test_the_predictor_writes_the_shared_kv_buffer_in_place(kernels: str) -> None:
    """With the C++ attention kernel this CPU selects (KV write included) and with dygraph's."""
    threads = configure_paddle(1)
    config = ModelConfig.from_dir(TINY_MODEL_DIR)
    weights = load_weights(TINY_MODEL_DIR, config, "float32")
    chosen = CpuKernels.select() if kernels == "selected" else CpuKernels.portable()
    model = build_model("predictor", config, weights, 64, threads, chosen)
    assert model.backend_name == "predictor"
    assert (model.attention is not None) == (kernels == "selected")
    small = KVCache(config.num_hidden_layers, 2, 16, config.num_key_value_heads, config.head_dim)
    few = _tiny_step(model, small, config, tokens=3)  # in dygraph: below eager_below_tokens
    assert model.predictor_steps == 0
    want = _tiny_step(model.eager, KVCache(*small_args(config)), config, tokens=3)
    assert np.abs(few - want).max() <= 1e-5 * np.abs(want).max()
    shape = (config.num_hidden_layers, 2, config.num_key_value_heads, 2, 16, config.head_dim)
    buffer = bytearray(int(np.prod(shape)) * 4)  # stands in for the shared-memory segment
    cache = KVCache(shape[0], 2, 16, shape[2], shape[5], buffer=memoryview(buffer))
    logits = _tiny_step(model, cache, config)
    assert model.predictor_steps == 1
    seen = np.frombuffer(buffer, dtype=np.float32).reshape(shape)
    assert np.abs(seen[:, :, :, 1, :9]).min(axis=-1).all()  # every layer, K and V, all 9 slots
    assert not seen[:, :, :, 1, 9:].any() and not seen[:, :, :, 0].any()
    eager_cache = KVCache(shape[0], 2, 16, shape[2], shape[5])
    eager = _tiny_step(model.eager, eager_cache, config)
    assert np.abs(logits - eager).max() <= 1e-5 * np.abs(eager).max()
    np.testing.assert_allclose(cache.array, eager_cache.array, rtol=1e-5, atol=1e-5)


def small_args(config: ModelConfig) -> tuple[int, ...]:
    return config.num_hidden_layers, 2, 16, config.num_key_value_heads, config.head_dim


def _backend_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ketch.engine.models.backend"]


def test_auto_takes_native_then_predictor_then_eager_with_one_log_line(monkeypatch, caplog) -> None:
    from ketch.engine.models import llama_native, llama_predictor
    from ketch.kernels import cpp_ops

    threads = configure_paddle(1)
    config = ModelConfig.from_dir(TINY_MODEL_DIR)
    weights = load_weights(TINY_MODEL_DIR, config, "float32")

    def build_auto():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ketch.engine.models.backend"):
            model = build_model("auto", config, weights, 64, threads)
        return model, _backend_records(caplog)

    def refuse(why: str):
        def raises(*args, **kwargs):
            raise RuntimeError(why)

        return raises

    model, records = build_auto()
    assert model.backend_name == "native" and not records

    # Without OpenBLAS the native backend keeps its packed GEMM or paddle.matmul: still native,
    # no backend line; forced to paddle.matmul, it runs on that alone.
    monkeypatch.setattr(cpp_ops, "gemm_ops", refuse("no OpenBLAS on this machine"))
    model, records = build_auto()
    assert model.backend_name == "native" and not isinstance(model.linear, Linear)
    assert not records
    monkeypatch.setenv(ENV, "paddle")
    model, records = build_auto()
    assert model.backend_name == "native" and model.linear is paddle.matmul and not records
    monkeypatch.delenv(ENV)

    monkeypatch.setattr(llama_native, "NativeLlamaModel", refuse("no native kernels here"))
    model, (record,) = build_auto()
    assert model.backend_name == "predictor" and record.levelno == logging.WARNING
    assert "backend: predictor" in record.getMessage() and "no native" in record.getMessage()
    with pytest.raises(RuntimeError, match="no native"):
        build_model("native", config, weights, 64, threads)  # asked for: no silent fallback

    monkeypatch.setattr(llama_predictor, "DensePrograms", refuse("no predictor on this machine"))
    model, (record,) = build_auto()
    assert isinstance(model, LlamaModel)
    assert record.levelno == logging.WARNING and "backend: eager" in record.getMessage()
    assert "no predictor" in record.getMessage() and "no native" in record.getMessage()
    with pytest.raises(RuntimeError, match="no predictor"):
        build_model("predictor", config, weights, 64, threads)
    with pytest.raises(ValueError, match="unknown backend"):
        build_model("fast", config, weights, 64, threads)


def test_native_needs_the_cpp_attention_kernel() -> None:
    threads = configure_paddle(1)
    config = ModelConfig.from_dir(TINY_MODEL_DIR)
    weights = load_weights(TINY_MODEL_DIR, config, "float32")
    with pytest.raises(RuntimeError, match="paged-attention kernel"):
        build_model("native", config, weights, 64, threads, CpuKernels.portable())


def test_the_switch_reaches_the_engine_config() -> None:
    from ketch.engine.config import EngineConfig

    assert EngineConfig().backend == "auto"
    with pytest.raises(ValueError, match="backend"):
        EngineConfig(backend="fast")


def test_nothing_written_outside_the_cache_dir(tmp_path: Path) -> None:
    before = set(tmp_path.iterdir())
    export_programs(SHAPE, tmp_path / "c")
    assert set(tmp_path.iterdir()) - before == {tmp_path / "c"}
