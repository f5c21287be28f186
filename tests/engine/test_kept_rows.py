"""The native model's last layer on the kept rows only (``KeptRows``): a prompt chunk needs that
layer's K/V for every token but its attention, MLP and norm only where logits or hidden states
are read. The logits and hidden states must be those of the whole-rows forward, and those at
the logit rows must equal Hugging Face's at the same positions.

The step mixes what a real one does: a chunk that ends its prompt (its last row kept), a chunk
that does not (no row kept), a decode, a whole-prompt embedding request (every row kept, as mean
pooling asks), and a prompt_logprobs-like middle row (kept rows need not be a suffix).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
import torch
from tp_harness import BLOCK

from hf_models import hf_model
from ketch.engine import LLM, SamplingParams
from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama_native import KeptRows, NativeLlamaModel
from ketch.engine.models.loader import TINY_MODEL_DIR, load_weights
from ketch.engine.worker.kv_cache import KVCache
from ketch.engine.worker.model_runner import configure_paddle
from ketch.kernels import CpuKernels

# (prompt length, tokens computed before the step, tokens in the step)
SEQUENCES = [(70, 20, 50), (90, 10, 40), (33, 32, 1), (25, 0, 25), (40, 0, 40)]
EXACT = 1e-5  # the kept-rows forward against the whole-rows one
TOLERANCE = 1e-4  # against transformers


def native(path):
    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    return build_model("native", config, weights, 1024, configure_paddle(None), CpuKernels.select())


def flat(tokens, tables, which: str):
    """The flat ids, positions and spans of ``SEQUENCES``' prefixes (``which == "prefix"``) or
    of their step."""
    ids, pos, spans = [], [], []
    for seq, (_, done, n), table in zip(tokens, SEQUENCES, tables, strict=True):
        lo, hi = (0, done) if which == "prefix" else (done, done + n)
        if hi > lo:
            spans.append(SequenceSpan(len(ids), hi - lo, hi, table))
            ids += seq[lo:hi]
            pos += list(range(lo, hi))
    return ids, pos, spans


def forward(model, cache, batch, rows=None, hidden=None, kept: bool = False):
    ids, pos, spans = batch
    rows = list(range(len(ids))) if rows is None else rows
    extra = {} if hidden is None else {"hidden_rows": paddle.to_tensor(np.asarray(hidden))}
    if kept:
        extra["kept"] = KeptRows.build(spans, rows, hidden, BLOCK)
        assert extra["kept"] is not None
    with paddle.no_grad():
        return model.forward(
            paddle.to_tensor(np.asarray(ids, dtype=np.int64)),
            paddle.to_tensor(np.asarray(pos, dtype=np.int64)),
            cache.layers,
            model.metadata(spans, BLOCK, cache.num_blocks),
            paddle.to_tensor(np.asarray(rows, dtype=np.int64)),
            **extra,
        )


def last_layer_kv(cache) -> tuple[np.ndarray, np.ndarray]:
    layer = cache.layers[-1]
    return layer.k_blocks.numpy().copy(), layer.v_blocks.numpy().copy()


@pytest.mark.parametrize("name", ["qwen2", "llama-linear-bias", "qwen3", "tiny"])
def test_last_layer_on_kept_rows_equals_every_row(checkpoint, name: str) -> None:
    path = TINY_MODEL_DIR if name == "tiny" else checkpoint(name)
    config = ModelConfig.from_dir(path)
    model = native(path)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, config.vocab_size, total).tolist() for total, _, _ in SEQUENCES]
    tables, next_block = [], 1
    for total, _, _ in SEQUENCES:
        tables.append(list(range(next_block, next_block + -(-total // BLOCK))))
        next_block += len(tables[-1])
    cache = KVCache(
        config.num_hidden_layers, next_block, BLOCK, config.num_key_value_heads, config.head_dim
    )
    forward(model, cache, flat(tokens, tables, "prefix"))
    batch = flat(tokens, tables, "step")
    a, _partial, decode, embed, scored = batch[2]
    # Rows read: a's last (it ends its prompt), none of the second (its prompt goes on), the
    # decode, every row of the embedding request (mean pooling) and its last for logits, and a
    # middle row of the last request (a scored prompt row) with its last.
    rows = [a.start + a.query_len - 1, decode.start, embed.start + embed.query_len - 1,
            scored.start + 7, scored.start + scored.query_len - 1]  # fmt: skip
    hidden = list(range(embed.start, embed.start + embed.query_len))
    # The kept-rows call first, on a cache without the step's K/V: it must write every row's,
    # the partial chunk's included (its continuation attends to them). The whole-rows call then
    # writes the same bits again.
    kept_logits, kept_states = forward(model, cache, batch, rows, hidden, kept=True)
    kept_kv = last_layer_kv(cache)
    logits, states = forward(model, cache, batch, rows, hidden)
    for got, want in zip(kept_kv, last_layer_kv(cache), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in ((kept_logits, logits), (kept_states, states)):
        got, want = got.numpy(), want.numpy()
        assert got.shape == want.shape
        assert np.abs(got - want).max() / np.abs(want).max() <= EXACT

    positions = [(0, SEQUENCES[0][0] - 1), (2, SEQUENCES[2][0] - 1), (3, SEQUENCES[3][0] - 1),
                 (4, 7), (4, SEQUENCES[4][0] - 1)]  # fmt: skip
    hf = hf_model(path)
    with torch.no_grad():
        for (seq, at), got in zip(positions, kept_logits.numpy(), strict=True):
            want = hf(torch.tensor([tokens[seq][: at + 1]])).logits[0, -1].numpy()
            assert np.abs(got - want).max() / np.abs(want).max() <= TOLERANCE, (seq, at)


def test_every_row_needed_means_nothing_kept() -> None:
    spans = [SequenceSpan(0, 1, 30, [1, 2]), SequenceSpan(1, 1, 5, [3])]
    assert KeptRows.build(spans, [0, 1], None, BLOCK) is None
    chunk = [SequenceSpan(0, 4, 4, [1])]
    assert KeptRows.build(chunk, [3], [0, 1, 2, 3], BLOCK) is None  # mean pooling: all rows
    kept = KeptRows.build(chunk, [3], None, BLOCK)
    assert kept.rows.numpy().tolist() == [3]
    assert kept.meta.context_lens.numpy().tolist() == [4]
    assert kept.logit_rows.numpy().tolist() == [0] and kept.hidden_rows is None


def test_the_runner_keeps_rows_on_prompt_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own steps take the kept-rows path: a prompt step keeps its last row, a
    decode step builds nothing."""
    built = []

    def spy(*args):
        built.append(KeptRows.build(*args))
        return built[-1]

    monkeypatch.setattr(NativeLlamaModel, "kept_rows", staticmethod(spy))
    llm = LLM("tiny", block_size=16, kv_cache_memory="16MiB", backend="native")
    [out] = llm.generate([list(range(1, 41))], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.outputs[0].token_ids) == 3
    assert [k is None for k in built] == [False, True, True]
    assert built[0].rows.numpy().tolist() == [39]
