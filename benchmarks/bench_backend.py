"""Execution backends for one forward step, side by side in one process (ratios, medians).

Variants, on the same weights and the same paged KV cache:
  eager          LlamaModel in dygraph (the reference)
  native         the native backend (``--backend native``/``auto``): dygraph on Ketch's C++ ops,
                 matmuls through OpenBLAS, fused RMSNorm/rotary, C++ paged attention
  static-split   the dense programs of ketch.kernels.dense_graph through paddle.jit.to_static,
                 called from dygraph; attention in dygraph between them
  predictor-split the same programs on the paddle inference predictor with oneDNN
  predictor+kernel the same, attention and KV write in the C++ paged-attention op (what
                 ``--backend predictor``/``auto`` runs for steps of >= 7 tokens; smaller ones
                 run eagerly)
  predictor-full the whole step, attention and in-place KV writes included (index_put_), as one
                 predictor program; single attention group only, so a benchmark, not a backend
  static-full    that program through to_static, called from dygraph
  predictor-full+kernel the whole step as one predictor program around the C++ ops (KV write
                 and varlen paged attention in the program, caches written in place)

Cases: decode steps at batch 1, 8 and 32 (context ~200 each) and one prefill chunk of 256 tokens.
Usage: benchmarks/bench_backend.py [--model PATH] [--threads 1] [--rounds 15]
Without --model it writes a random 23M-parameter Qwen2 (hidden 512, 8 layers, 8/2 heads, head dim
64, intermediate 1408, tied embeddings) with transformers (the test extra) to a temp dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BLOCK = 16


def make_23m(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_models import make_checkpoint

    return make_checkpoint(
        out,
        "qwen2",
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def full_program(shape, layers: int):
    """The whole step as one static function: dense layers, KV writes, one attention group."""
    import paddle
    import paddle.nn.functional as F

    from ketch.kernels import dense_graph as g

    s = shape
    group = s.heads // s.kv_heads

    def attention(q, k, v, k_slots, v_slots, write_index, query_index, block_index, mask):
        d, kvh = s.head_dim, s.kv_heads
        k_slots = paddle.index_put_(
            k_slots, (write_index,), k.transpose([1, 0, 2]).reshape([-1, d])
        )
        v_slots = paddle.index_put_(
            v_slots, (write_index,), v.transpose([1, 0, 2]).reshape([-1, d])
        )
        dims = paddle.shape(mask)
        b, sq, sk = dims[0], dims[2], dims[3]
        qg = (paddle.gather(q, query_index) * d**-0.5).reshape([b, sq, kvh, group, d])
        qg = qg.transpose([2, 0, 3, 1, 4]).reshape([kvh, b, group * sq, d])
        kb = paddle.gather(k_slots.reshape([kvh, -1, BLOCK, d]), block_index, axis=1)
        vb = paddle.gather(v_slots.reshape([kvh, -1, BLOCK, d]), block_index, axis=1)
        kb, vb = kb.reshape([kvh, b, sk, d]), vb.reshape([kvh, b, sk, d])
        scores = paddle.matmul(qg, kb, transpose_y=True).reshape([kvh, b, group, sq, sk]) + mask
        probs = F.softmax(scores, axis=-1).reshape([kvh, b, group * sq, sk])
        out = paddle.matmul(probs, vb).reshape([kvh, b, group, sq, d])
        out = out.transpose([1, 3, 0, 2, 4]).reshape([-1, s.heads * d])
        return out, k_slots, v_slots

    def step(input_ids, cos, sin, write_index, query_index, block_index, mask, rows, caches, ws):
        w = g._Weights(list(ws))
        h = F.embedding(input_ids, w.take())
        new_caches = []
        attn = None
        for i in range(layers):
            if i:
                h = g._finish_layer(s, h, attn, w)
            q, k, v = g._project_qkv(s, h, cos, sin, w)
            attn, kc, vc = attention(
                q,
                k,
                v,
                caches[2 * i],
                caches[2 * i + 1],
                write_index,
                query_index,
                block_index,
                mask,
            )
            new_caches += [kc, vc]
        h = g._finish_layer(s, h, attn, w)
        x = g._rms_norm(paddle.gather(h, rows), w.take(), s.eps)
        return [paddle.matmul(x, w.take()), *new_caches]

    return step


def kernel_program(shape, layers: int, isa: str):
    """The whole step as one static function around the C++ ops: dense layers, KV writes
    (ketch_reshape_and_cache, in place on the cache inputs) and varlen paged attention, so a
    mixed batch is one call. The caches are returned too: in-place results that are not
    fetched are pruned from the saved program."""
    import paddle

    from ketch.kernels import cpp_ops
    from ketch.kernels import dense_graph as g

    ops = cpp_ops.ops()
    s = shape

    def step(input_ids, cos, sin, tables, starts, lens, slots, rows, caches, ws):
        w = g._Weights(list(ws))
        h = paddle.nn.functional.embedding(input_ids, w.take())
        new_caches, attn = [], None
        for i in range(layers):
            if i:
                h = g._finish_layer(s, h, attn, w)
            q, k, v = g._project_qkv(s, h, cos, sin, w)
            kc, vc = ops.ketch_reshape_and_cache(k, v, caches[2 * i], caches[2 * i + 1], slots)
            out = ops.ketch_paged_attention(
                q, kc, vc, tables, starts, lens, s.head_dim**-0.5, 1, isa, 0
            )
            attn = out.reshape([0, s.heads * s.head_dim])
            new_caches += [kc, vc]
        h = g._finish_layer(s, h, attn, w)
        x = g._rms_norm(paddle.gather(h, rows), w.take(), s.eps)
        return [paddle.matmul(x, w.take()), *new_caches]

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.model) if args.model else make_23m(Path(tmp.name) / "qwen2-23m")
    os.environ.setdefault("KETCH_CACHE_DIR", str(Path(tmp.name) / "cache"))
    bench = Bench(path, args.threads)
    cases = {
        "decode b=1": bench.decode_case(1, 200),
        "decode b=8": bench.decode_case(8, 200),
        "decode b=32": bench.decode_case(32, 200),
        "prefill 256": bench.prefill_case(256),
    }
    print(f"model {path.name}, {args.threads} thread(s), medians of {args.rounds} rounds")
    print(f"{'case':14s} {'variant':22s} {'ms':>8s} {'x eager':>8s} {'max rel err':>12s}")
    for name, case in cases.items():
        times, errors = bench.measure(case, args.rounds)
        for variant, t in times.items():
            ratio = times["eager"] / t
            print(f"{name:14s} {variant:22s} {t * 1e3:8.2f} {ratio:8.2f} {errors[variant]:12.1e}")


class Bench:
    def __init__(self, path: Path, threads: int) -> None:
        import paddle
        from paddle.static import InputSpec

        from ketch.engine.models.config import ModelConfig
        from ketch.engine.models.llama import LlamaModel
        from ketch.engine.models.llama_predictor import PredictorLlamaModel, dense_shape
        from ketch.engine.models.loader import load_weights
        from ketch.engine.worker.kv_cache import KVCache
        from ketch.engine.worker.model_runner import configure_paddle
        from ketch.kernels import dense_graph
        from ketch.kernels.predictor_backend import create_predictor, export_programs

        configure_paddle(threads)
        self.config = c = ModelConfig.from_dir(path)
        weights = load_weights(path, c, "float32")
        self.eager = LlamaModel(c, weights, max_len=2048)
        shape = dense_shape(c)
        self.pred = PredictorLlamaModel(c, weights, self.eager, threads)
        self.static = PredictorLlamaModel(c, weights, self.eager, threads)
        self.kernel = PredictorLlamaModel(c, weights, self.eager, threads)
        self.eager_kernel = PredictorLlamaModel(c, weights, self.eager, threads)
        self.eager_kernel.programs = _StaticPrograms(
            {k: dense_graph.PROGRAMS[k](shape) for k in ("first", "middle", "last")}
        )
        # Measure the programs at every size (the backend runs steps under 7 tokens in dygraph);
        # pred/static attend in dygraph, kernel in the C++ paged-attention op.
        for net in (self.pred, self.static, self.kernel, self.eager_kernel):
            net.eager_below_tokens = 0
        self.pred.attention = self.static.attention = None
        statics = {
            k: paddle.jit.to_static(
                dense_graph.PROGRAMS[k](shape), dense_graph.input_specs(shape, k), full_graph=True
            )
            for k in ("first", "middle", "last")
        }
        self.static.programs = _StaticPrograms(statics)
        self.cache = KVCache(
            c.num_hidden_layers, 40 * 18 + 1, BLOCK, c.num_key_value_heads, c.head_dim
        )
        self.weights = weights
        # The full-graph program.
        flat = [weights.embed]
        from ketch.engine.models.llama_predictor import _finish_weights, _qkv_weights

        for i, layer in enumerate(weights.layers):
            flat += (_finish_weights(weights.layers[i - 1]) if i else []) + _qkv_weights(layer)
        flat += [*_finish_weights(weights.layers[-1]), weights.norm, weights.lm_head]
        self.flat_weights = flat
        f32 = lambda shp: InputSpec(shp, "float32")  # noqa: E731
        i64 = lambda shp: InputSpec(shp, "int64")  # noqa: E731
        group = c.num_attention_heads // c.num_key_value_heads
        specs = [
            i64([None]),
            f32([None, c.head_dim]),
            f32([None, c.head_dim]),
            i64([None]),
            i64([None]),
            i64([None]),
            f32([None, group, None, None]),
            i64([None]),
            [f32([None, c.head_dim]) for _ in range(2 * c.num_hidden_layers)],
            [f32(list(t.shape)) for t in flat],
        ]
        fn = full_program(shape, c.num_hidden_layers)
        self.static_full = paddle.jit.to_static(fn, input_spec=specs, full_graph=True)
        out = Path(export_programs(shape)) / "bench_full"
        paddle.jit.save(self.static_full, str(out))
        self.full_dir = out.parent
        self.full_pred = create_predictor(out.parent, "bench_full", threads)
        if self.kernel.attention is None:
            sys.exit("bench_backend needs Ketch's C++ ops (ketch.kernels.cpp_ops), not built here")
        from ketch.engine.models.llama_native import NativeLlamaModel, measured_matmul

        matmul, line = measured_matmul(weights, threads)
        print(line, file=sys.stderr)
        self.native = NativeLlamaModel(c, weights, self.eager, matmul, self.kernel.attention)
        isa = self.kernel.attention.isa
        kv_block = [c.num_key_value_heads, None, BLOCK, c.head_dim]
        kspecs = [
            *specs[:3],
            InputSpec([None, None], "int32"),
            InputSpec([None], "int32"),
            InputSpec([None], "int32"),
            i64([None]),
            i64([None]),
            # one spec per cache: a shared spec object names them all alike, and the predictor
            # then binds every cache input to the same tensor
            [InputSpec(kv_block, "float32", f"cache_{i}") for i in range(2 * c.num_hidden_layers)],
            specs[-1],
        ]
        kfn = paddle.jit.to_static(
            kernel_program(shape, c.num_hidden_layers, isa), input_spec=kspecs, full_graph=True
        )
        paddle.jit.save(kfn, str(out.parent / "bench_kernel_full"))
        self.kernel_full = create_predictor(out.parent, "bench_kernel_full", threads)

    def _spans(self, q_lens: list[int], ctx_lens: list[int]):
        from ketch.engine.models.attention import SequenceSpan

        spans, start, per_seq = [], 0, 18
        for b, (q, n) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            table = list(range(1 + b * per_seq, 1 + (b + 1) * per_seq))
            spans.append(SequenceSpan(start, q, n, table))
            start += q
        return spans

    def decode_case(self, batch: int, context: int):
        rng = np.random.default_rng(0)
        self.cache.array[...] = rng.standard_normal(self.cache.array.shape, dtype=np.float32)
        ctx = [context + (b % 7) for b in range(batch)]
        return self._inputs(self._spans([1] * batch, ctx), [n - 1 for n in ctx], rng)

    def prefill_case(self, tokens: int):
        rng = np.random.default_rng(1)
        return self._inputs(self._spans([tokens], [tokens]), list(range(tokens)), rng)

    def _inputs(self, spans, positions, rng):
        import paddle

        from ketch.engine.models.attention import build_metadata

        c = self.config
        kv = c.num_key_value_heads
        meta = build_metadata(spans, BLOCK, self.cache.num_blocks, kv, c.num_attention_heads // kv)
        ids = rng.integers(1, c.vocab_size, len(positions))
        rows = np.array([s.start + s.query_len - 1 for s in spans], dtype=np.int64)
        return dict(
            ids=paddle.to_tensor(ids.astype(np.int64)),
            pos=paddle.to_tensor(np.array(positions, dtype=np.int64)),
            meta=meta,
            kernel_meta=self.kernel.metadata(spans, BLOCK, self.cache.num_blocks),
            rows=paddle.to_tensor(rows),
        )

    def _full_inputs(self, case):
        import paddle

        g = case["meta"].groups[0]
        cos = paddle.gather(self.eager._cos, case["pos"])
        sin = paddle.gather(self.eager._sin, case["pos"])
        caches = []
        for layer in self.cache.layers:
            caches += [layer.k_slots, layer.v_slots]
        meta = case["meta"]
        return [
            case["ids"],
            cos,
            sin,
            meta.write_index,
            g.query_index,
            g.block_index,
            g.masks[0],
            # the single group's rows are the flat order, so output_index is the identity
            case["rows"],
            caches,
            self.flat_weights,
        ]

    def measure(self, case, rounds: int):
        import paddle

        def model(net, meta="meta"):
            return lambda: net.forward(
                case["ids"], case["pos"], self.cache.layers, case[meta], case["rows"]
            )

        full = self._full_inputs(case)
        flat_inputs = full[:8] + full[8] + full[9]
        km = case["kernel_meta"]
        blocks = [t for layer in self.cache.layers for t in (layer.k_blocks, layer.v_blocks)]
        kernel_inputs = [
            *full[:3], km.block_tables, km.query_start, km.context_lens, km.slot_mapping,
            case["rows"], *blocks, *self.flat_weights,
        ]  # fmt: skip
        variants = {
            "eager": model(self.eager),
            "native": model(self.native, "kernel_meta"),
            "static-split": model(self.static),
            "predictor-split": model(self.pred),
            "predictor+kernel": model(self.kernel, "kernel_meta"),
            "dygraph+kernel": model(self.eager_kernel, "kernel_meta"),
            "predictor-full": lambda: self.full_pred.run(flat_inputs)[0],
            "predictor-full+kernel": lambda: self.kernel_full.run(kernel_inputs)[0],
            "static-full": lambda: self.static_full(*full)[0],
        }
        with paddle.no_grad():
            ref = variants["eager"]().numpy()
            errors = {}
            for k, f in variants.items():
                out = f().numpy()
                errors[k] = float(np.abs(out - ref).max() / np.abs(ref).max())
            times = {k: [] for k in variants}
            for _ in range(rounds):
                for k, f in variants.items():
                    start = time.perf_counter()
                    f().numpy()
                    times[k].append(time.perf_counter() - start)
        return {k: float(np.median(v)) for k, v in times.items()}, errors


class _StaticPrograms:
    def __init__(self, statics) -> None:
        self.statics = statics

    def run(self, kind, inputs):
        first = {"first": 3, "middle": 4, "last": 3}[kind]
        out = self.statics[kind](*inputs[:first], inputs[first:])
        return list(out) if isinstance(out, (list, tuple)) else [out]


if __name__ == "__main__":
    main()
