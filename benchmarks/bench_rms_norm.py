"""RMSNorm: the portable formula against paddle's fused AVX-512 kernel, same run, same thread.

(a) the op alone on [tokens, hidden] shapes a step sees;
(b) whole forward steps of a compute-bound model (random Qwen2, hidden 512, 8 layers, 8 heads /
    2 KV heads, intermediate 1408: the 23M shape of the vLLM comparison): a batch-32 decode step
    over ~170-token contexts and a 256-token prefill.

Ratios are portable ÷ fused time (above 1: the fused kernel is faster). On a CPU without AVX-512
only the portable column is measured (the fused kernel would die with SIGILL there).

Usage: benchmarks/bench_rms_norm.py [--threads 1] [--repeats 200]
Needs the test extra (transformers, torch) to write the random checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SHAPES = [(1, 512), (32, 512), (256, 512), (2048, 512), (32, 4096)]
BLOCK = 16


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function over ``repeats`` rounds, after a warm-up. The functions
    take turns within every round, so drift on a noisy machine hits them alike."""
    for fn in fns.values():
        for _ in range(max(3, repeats // 20)):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_op(kernels: dict, repeats: int) -> list[tuple[str, dict[str, float]]]:
    import paddle

    rows = []
    rng = np.random.default_rng(0)
    for tokens, hidden in SHAPES:
        x = paddle.to_tensor(rng.standard_normal((tokens, hidden)).astype(np.float32))
        w = paddle.to_tensor(rng.standard_normal(hidden).astype(np.float32))
        fns = {name: lambda k=k, x=x, w=w: k.rms_norm(x, w, 1e-6) for name, k in kernels.items()}
        times = timed(fns, repeats)
        rows.append((f"rms_norm [{tokens}, {hidden}]", times))
    return rows


def make_model(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, torch_dtype="float32",
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def bench_model(path: Path, kernels: dict, repeats: int) -> list[tuple[str, dict[str, float]]]:
    import paddle

    from ketch.engine.models.attention import SequenceSpan, build_metadata
    from ketch.engine.models.config import ModelConfig
    from ketch.engine.models.llama import LlamaModel
    from ketch.engine.models.loader import load_weights
    from ketch.engine.worker.kv_cache import KVCache

    config = ModelConfig.from_dir(path)
    weights = load_weights(path, config, "float32")
    kv, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    cache = KVCache(config.num_hidden_layers, 32 * 16 + 1, BLOCK, kv, config.head_dim)

    def inputs(lengths: list[int], new: int) -> tuple:
        ids, pos, spans = [], [], []
        for i, n in enumerate(lengths):
            table = list(range(1 + i * 16, 1 + (i + 1) * 16))
            spans.append(SequenceSpan(len(ids), new, n, table))
            ids += [7] * new
            pos += range(n - new, n)
        meta = build_metadata(spans, BLOCK, cache.num_blocks, kv, group)
        rows = np.cumsum([new] * len(lengths)) - 1
        as_tensor = paddle.to_tensor
        return (as_tensor(np.array(ids)), as_tensor(np.array(pos)), meta, as_tensor(rows))

    cases = {"decode step, batch 32, context 170": inputs([170] * 32, 1),
             "prefill, 256 tokens": inputs([256], 256)}  # fmt: skip
    rows = []
    for label, (ids, pos, meta, logit_rows) in cases.items():
        fns = {}
        for name, k in kernels.items():
            model = LlamaModel(config, weights, max_len=2048, kernels=k)

            def step(model=model, ids=ids, pos=pos, meta=meta, logit_rows=logit_rows) -> None:
                with paddle.no_grad():
                    model.forward(ids, pos, cache.layers, meta, logit_rows)

            fns[name] = step
        times = timed(fns, max(10, repeats // 5))
        rows.append((label, times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="paddle compute threads (1)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per op shape")
    args = parser.parse_args()

    from ketch.engine.worker.model_runner import configure_paddle
    from ketch.kernels import CpuKernels
    from ketch.kernels.cpu_features import CpuFeatures
    from ketch.kernels.rms_norm import FUSED_OP

    configure_paddle(args.threads)
    features = CpuFeatures.detect()
    kernels = {"portable": CpuKernels.portable()}
    if features.can_run(FUSED_OP):
        kernels["fused"] = CpuKernels.select(features, log=False)
    print(f"CPU flags from {features.source}; AVX-512: {features.can_run(FUSED_OP)}; "
          f"{args.threads} thread(s)")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench_op(kernels, args.repeats) + bench_model(
            make_model(Path(tmp)), kernels, args.repeats
        )
    print("\n| case | portable | fused | portable ÷ fused |\n|---|---|---|---|")
    for label, times in rows:
        fused = times.get("fused")
        ratio = f"{times['portable'] / fused:.2f}" if fused else "n/a (no AVX-512)"
        fused_text = f"{fused * 1e3:.3f} ms" if fused else "-"
        print(f"| {label} | {times['portable'] * 1e3:.3f} ms | {fused_text} | {ratio} |")


if __name__ == "__main__":
    main()
