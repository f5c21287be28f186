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
from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.backend import build_model
from ketch.engine.models.config import ModelConfig
from ketch.engine.models.llama_native import KeptRows
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


def step(model, cache, tokens, tables, which: str, rows=None, hidden=None, kept=None):
    """One batched forward of ``SEQUENCES``' prefixes (``which == "prefix"``) or their step."""
    ids, pos, spans = [], [], []
    for seq, (_, done, n), table in zip(tokens, SEQUENCES, tables, strict=True):
        lo, hi = (0, done) if which == "prefix" else (done, done + n)
        if hi > lo:
            spans.append(SequenceSpan(len(ids), hi - lo, hi, table))
            ids += seq[lo:hi]
            pos += list(range(lo, hi))
    rows = list(range(len(ids))) if rows is None else rows
    extra = {} if hidden is None else {"hidden_rows": paddle.to_tensor(np.asarray(hidden))}
    if kept is not None:
        extra["kept"] = KeptRows.build(spans, rows, hidden, BLOCK)
        assert extra["kept"] is not None
    with paddle.no_grad():
        out = model.forward(
            paddle.to_tensor(np.asarray(ids, dtype=np.int64)),
            paddle.to_tensor(np.asarray(pos, dtype=np.int64)),
            cache.layers,
            model.metadata(spans, BLOCK, cache.num_blocks),
            paddle.to_tensor(np.asarray(rows, dtype=np.int64)),
            **extra,
        )
    return spans, out


@pytest.mark.parametrize("name", ["qwen2", "llama-linear-bias", "tiny"])
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
    step(model, cache, tokens, tables, "prefix")
    spans, _ = step(model, cache, tokens, tables, "step")
    a, _partial, decode, embed, scored = spans
    # Rows read: a's last (it ends its prompt), none of the second (its prompt goes on), the
    # decode, every row of the embedding request (mean pooling) and its last for logits, and a
    # middle row of the last request (a scored prompt row) with its last.
    rows = [a.start + a.query_len - 1, decode.start, embed.start + embed.query_len - 1,
            scored.start + 7, scored.start + scored.query_len - 1]  # fmt: skip
    hidden = list(range(embed.start, embed.start + embed.query_len))
    # The step's K/V are already in the cache from the call above; writing them again is the
    # same bits, so both calls below see the same cache.
    _, (logits, states) = step(model, cache, tokens, tables, "step", rows, hidden)
    _, (kept_logits, kept_states) = step(model, cache, tokens, tables, "step", rows, hidden, True)
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

    # The partial chunk's K/V reached the last layer's cache: its continuation sees them.
    layer = cache.layers[-1]
    assert float(paddle.abs(layer.k_blocks[:, tables[1][49 // BLOCK]]).sum()) > 0  # 48..49


def test_every_row_needed_means_nothing_kept() -> None:
    spans = [SequenceSpan(0, 1, 30, [1, 2]), SequenceSpan(1, 1, 5, [3])]
    assert KeptRows.build(spans, [0, 1], None, BLOCK) is None
    chunk = [SequenceSpan(0, 4, 4, [1])]
    assert KeptRows.build(chunk, [3], [0, 1, 2, 3], BLOCK) is None  # mean pooling: all rows
    kept = KeptRows.build(chunk, [3], None, BLOCK)
    assert kept.rows.numpy().tolist() == [3]
    assert kept.meta.context_lens.numpy().tolist() == [4]
    assert kept.logit_rows.numpy().tolist() == [0] and kept.hidden_rows is None
