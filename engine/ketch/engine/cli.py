"""The ``ketch`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
from collections.abc import Sequence

from ketch.engine.cli_args import add_engine_args, engine_config_from_args
from ketch.engine.lifecycle import watch_supervisor

_GENERATE_EXAMPLES = """examples:
  ketch generate "Alice was beginning to get"
  ketch generate --temperature 0.8 --seed 7 --max-tokens 100 "Once upon a time"
  ketch generate --chat "What happened to Alice?"
  ketch generate --model /models/Qwen2-0.5B --json "Hello" "Bonjour"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ketch",
        allow_abbrev=False,
        description="Ketch: LLM serving on Kubernetes. The engine's command-line entry point.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        allow_abbrev=False,
        help="generate text offline for one or more prompts",
        description="Runs prompts through the engine in-process and prints the completions.",
        epilog=_GENERATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text(s)")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (64)")
    sampling.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy (the default); higher is more random",
    )
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="treat each prompt as a user message and apply the chat template",
    )
    generate.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt instead of plain text"
    )
    generate.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="engine log level",
    )
    add_engine_args(generate)
    fetch = commands.add_parser(
        "fetch-model",
        allow_abbrev=False,
        help="download a model (hf:// or s3://) into a directory",
        description="Fetches a model's config, tokenizer and safetensors weights into DEST, as the "
        "operator's init container does. tiny, file:// and pvc:// models need no fetching. hf:// "
        "uses $HF_TOKEN; s3:// uses the usual AWS_* variables (AWS_ENDPOINT_URL for S3-compatible "
        "stores). Needs: pip install 'ketch[fetch]'.",
    )
    fetch.add_argument("uri", help="hf://org/name[@revision] or s3://bucket/prefix")
    fetch.add_argument("dest", help="directory to fill")
    fetch.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    from ketch.engine.cache_manager.cli import add_cache_manager_parser
    from ketch.engine.router.cli import add_router_parser
    from ketch.engine.serving.serve import add_serve_parser

    add_serve_parser(commands)
    add_cache_manager_parser(commands)
    add_router_parser(commands)
    return parser


def config_file_classes(args: argparse.Namespace) -> tuple[type, ...]:
    """The settings the subcommand's ``--config`` file may hold (none: it takes no file)."""
    module = _command_module(args.command)
    return module.config_file_classes() if module else ()


def listening_ports(args: argparse.Namespace, file_values: dict | None = None) -> dict[int, str]:
    """``{port: Listener(flag)}`` the parsed command would listen on, given its config file's
    values; builds the command's real configs, so a bad value raises the ValueError ``main``
    prints. ``generate`` and ``fetch-model`` listen on nothing."""
    module = _command_module(args.command)
    return module.listening_ports(args, file_values) if module else {}


def _command_module(command: str) -> types.ModuleType | None:
    """The CLI module of ``serve``, ``cache-manager`` or ``router``; None for the others."""
    if command == "serve":
        from ketch.engine.serving import serve

        return serve
    if command == "cache-manager":
        from ketch.engine.cache_manager import cli

        return cli
    if command == "router":
        from ketch.engine.router import cli

        return cli
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # force: importing paddle already gave the root logger an INFO handler of its own.
    logging.basicConfig(
        level=args.log_level, format="%(levelname)s %(name)s: %(message)s", force=True
    )
    try:
        watch_supervisor()  # KETCH_WATCH_PID: stop when that process is gone
        if args.command == "fetch-model":
            from ketch.engine.models.fetch import fetch_model

            print(fetch_model(args.uri, args.dest))
            return 0
        if args.command == "serve":
            from ketch.engine.serving.serve import run_serve

            return run_serve(args)
        if args.command == "cache-manager":
            from ketch.engine.cache_manager.cli import run_cache_manager

            return run_cache_manager(args)
        if args.command == "router":
            from ketch.engine.router.cli import run_router

            return run_router(args)
        return _generate(args)
    except ValueError as exc:  # bad flags, bad prompts, bad model directories
        print(f"ketch: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the engine could not start
        print(f"ketch: error: {exc}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    from ketch.engine.llm import LLM
    from ketch.engine.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(config.model, **kwargs)
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                    }
                )
            )
        elif args.chat:
            print(completion.text)
        else:
            print(prompt + completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
