"""engine.extraArgs cannot override what the operator sets, and no parser takes abbreviations.

argparse accepts any unambiguous prefix of a long flag unless the parser says
``allow_abbrev=False``: ``--pd-prefill-pe x`` would set ``--pd-prefill-peers``. Every parser of
the project refuses abbreviations, and the operator refuses every flag it owns in extraArgs, as
written, as ``--flag=value`` and abbreviated (for an older engine image that still takes them).
"""

from __future__ import annotations

import argparse
import contextlib
import io

import celpy
import pytest
import yaml
from test_builders import ROOT, example

from ketch.engine.cli import build_parser as ketch_parser
from ketch.operator.cli import build_parser as operator_parser
from ketch.operator.cli import render_object
from ketch.operator.crd import engine_fields
from ketch.operator.crd.document import crd_document
from ketch.operator.spec.checks import extra_args_problems
from ketch.operator.spec.parse import InvalidSpec, parse
from ketch.operator.wiring import check_wiring


def _extra_args_schema() -> dict:
    spec = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["engine"]["properties"]["extraArgs"]


def _cel_accepts(args: list[str]) -> bool:
    (rule,) = _extra_args_schema()["x-kubernetes-validations"]
    env = celpy.Environment()
    program = env.program(env.compile(rule["rule"]))
    return bool(program.evaluate({"self": celpy.json_to_cel(args)}))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _serve_flags() -> set[str]:
    serve = _subparsers(ketch_parser())["serve"]
    return {s for a in serve._actions for s in a.option_strings}


def with_extra_args(*args: str) -> dict:
    body = example("mixed")
    body["spec"]["engine"]["extraArgs"] = list(args)
    return body


# --------------------------------------------------------------------------- which flags


def test_the_operator_owns_every_serve_flag_but_the_log_level():
    """Every setting of `ketch serve` comes from the role's config file, which the operator
    writes (or from a default it relies on, like --host 0.0.0.0): a flag would override it."""
    owned = set(engine_fields.owned_flags())
    assert owned <= _serve_flags()
    assert _serve_flags() - owned == {"-h", "--help", "--log-level"}
    assert {"--pd-prefill-peers", "--config", "--model", "--host"} <= owned
    assert "--no-enable-prefix-caching" in owned  # BooleanOptionalAction's other spelling


def test_no_flag_left_to_extra_args_is_a_prefix_of_an_owned_one():
    """The prefix checks refuse anything an owned flag starts with; that must never catch a
    whole flag extraArgs may use."""
    owned = engine_fields.owned_flags()
    for flag in _serve_flags() - set(owned):
        assert not [f for f in owned if f.startswith(flag)], flag


# --------------------------------------------------------------------------- the operator's check

REFUSED = [
    (["--pd-prefill-pe", "x"], "--pd-prefill-peers"),
    (["--api-key-f=/x"], "--api-key-file"),
    (["--engine-worker-queue-p", "1"], "--engine-worker-queue-port"),
    (["--max-num-se=4"], "--max-num-seqs"),
    (["--pd-prefill-peers=evil.example"], "--pd-prefill-peers"),
    (["--port=1"], "--port"),
    (["--config", "/tmp/mine.yaml"], "--config"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["--log-level", "DEBUG", "--ho=1.2.3.4"], "--host"),
]


@pytest.mark.parametrize(("args", "flag"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
@pytest.mark.parametrize("cel", [True, False], ids=["cel", "no-cel"])
def test_owned_flags_are_refused_however_spelled(args, flag, cel):
    """Refused with or without the CEL rules: the operator runs its own check on objects the
    API server already admitted (its CRD may be older)."""
    with pytest.raises(InvalidSpec) as info:
        parse(with_extra_args(*args), cel=cel)
    index = next(i for i, a in enumerate(args) if a.startswith("--") and a != "--log-level")
    [problem] = [p for p in info.value.problems if p.startswith("spec.engine.extraArgs[")]
    assert problem.startswith(f"spec.engine.extraArgs[{index}]: {args[index]!r}")
    assert flag in problem and (
        "the operator sets from" in problem or "only the operator" in problem
    )


def test_the_message_names_the_field_to_set_instead():
    [port] = extra_args_problems(["--port=1"])
    assert port == (
        "spec.engine.extraArgs[0]: '--port=1' sets --port, which the operator sets from "
        "spec.ports.http: set that instead"
    )
    [seqs] = extra_args_problems(["--max-num", "8"])
    assert "abbreviates --max-num-batched-tokens or --max-num-seqs" in seqs
    assert "spec.engine.maxNumSeqs" in seqs
    [peers] = extra_args_problems(["--pd-prefill-pe", "x"])
    assert peers.endswith("abbreviates --pd-prefill-peers, which only the operator may set")


def test_flags_the_operator_does_not_own_and_values_pass():
    assert extra_args_problems(["--log-level", "DEBUG", "--", "8", "x=--port", "-p"]) == []
    parse(with_extra_args("--log-level", "DEBUG"))


def test_abbreviated_flags_the_operator_does_not_own_fail_the_wiring_check():
    """Not refused by the spec check, but the engine's parser refuses abbreviations: the
    wiring check reports argparse's error before a pod crash-loops on it."""
    [problem] = check_wiring(render_object(with_extra_args("--log-l", "DEBUG")))
    assert "unrecognized arguments: --log-l DEBUG" in problem


# --------------------------------------------------------------------------- the CRD's CEL rule


@pytest.mark.parametrize("flag", engine_fields.owned_flags())
def test_cel_rule_refuses_each_owned_flag_exact_with_value_and_abbreviated(flag):
    assert not _cel_accepts([flag])
    assert not _cel_accepts(["--log-level", "INFO", f"{flag}=1"])
    assert not _cel_accepts([flag[:-1], "1"])  # an abbreviation


def test_cel_rule_accepts_what_is_not_an_owned_flag():
    assert _cel_accepts([])
    assert _cel_accepts(["--log-level", "DEBUG", "--", "-p", "8", "x=--port"])


def test_cel_rule_is_bounded_and_regex_free():
    """Its cost is bounded by maxItems x maxLength x the owned flags, with prefix tests only:
    the API server estimates a regex over unbounded strings far above its budget."""
    schema = _extra_args_schema()
    assert schema["maxItems"] <= 64 and schema["items"]["maxLength"] <= 1024
    (rule,) = schema["x-kubernetes-validations"]
    assert "matches" not in rule["rule"]
    too_long = with_extra_args("x" * 1025)
    with pytest.raises(InvalidSpec, match=r"extraArgs\[0\]"):
        parse(too_long, cel=False)


# --------------------------------------------------------------------------- the parsers


def _all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for name, parser in (("ketch", ketch_parser()), ("ketch-operator", operator_parser())):
        out.append((name, parser))
        out += [(f"{name} {sub}", p) for sub, p in _subparsers(parser).items()]
    return out


@pytest.mark.parametrize(("name", "parser"), _all_parsers(), ids=[n for n, _ in _all_parsers()])
def test_every_parser_refuses_abbreviations(name, parser):
    assert parser.allow_abbrev is False, name


@pytest.mark.parametrize("argv", [["serve", "--max-num-se", "4"], ["serve", "--max-num-se=4"]])
def test_ketch_serve_refuses_an_abbreviated_flag_with_argparse_error(argv):
    err = io.StringIO()
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(err):
        ketch_parser().parse_args(argv)
    assert info.value.code == 2
    assert "unrecognized arguments: --max-num-se" in err.getvalue()
    args = ketch_parser().parse_args(["serve", "--max-num-seqs", "4"])
    assert args.max_num_seqs == 4


def test_examples_use_no_owned_flag():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        extra = yaml.safe_load(path.read_text())["spec"].get("engine", {}).get("extraArgs", [])
        assert extra_args_problems(extra) == [], path
