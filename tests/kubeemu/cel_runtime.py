"""CEL programs on celpy, fast enough for admission: parsed once with one shared parser,
checked for supported functions, transpiled to Python and run with a light activation.

celpy's own ``Activation`` spends most of an evaluation on name resolution (about 6x slower), and
its comparison helpers and literal constructors are wrapped per call; :class:`_EvalGlobals`
gives transpiled code a private view of celpy with those done once. Evaluation errors are turned
into cel-go's wording by :func:`eval_error_text`.
"""

from __future__ import annotations

import operator
import re
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celpy
import celpy.evaluation as _celev
import lark
from celpy import celtypes
from celpy.celparser import CELParser
from celpy.evaluation import CELEvalError

from kubeemu.causes import CRDSchemaError
from kubeemu.cel_library import EXT, EXT_MODULE, EXT_NS, INT64_MAX, INT64_MIN

# Macros celpy expands itself (the bind-variable forms) and function-like macros.
_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_FUNC_MACROS = frozenset({"has", "dyn"})
# celpy base functions that are real CEL (operators are not called by name).
_BASE = frozenset(
    name
    for name in _celev.base_functions
    if name[0].isalpha() and name not in ("list", "map", "null_type")
)
_SUPPORTED = _BASE | frozenset(EXT)
_FUNCTIONS: dict[str, Any] = dict(EXT)
_SUPPORTED_TEXT = ", ".join(sorted({*(n for n in _SUPPORTED if not n.startswith("_")), "min"}))


def _fast_int(source: Any, *args: Any) -> Any:
    """``IntType(x)`` without celpy's per-call decorator for the common in-range int case."""
    if type(source) is int and INT64_MIN <= source <= INT64_MAX:
        return int.__new__(celtypes.IntType, source)
    return celtypes.IntType(source, *args)


_CEL_TRUE = celtypes.BoolType(True)
_CEL_FALSE = celtypes.BoolType(False)


class FastStr(celtypes.StringType):
    """StringType with C-level hashing/equality (celpy's delegate to str in Python code, which
    made every map lookup in a rule a pair of Python calls)."""

    __slots__ = ()
    __eq__ = str.__eq__
    __ne__ = str.__ne__
    __hash__ = str.__hash__


class FastMap(celtypes.MapType):
    """MapType whose ``get`` (how transpiled code reads ``self.field``) is a plain lookup."""

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return dict.__getitem__(self, key)
        except KeyError:
            if default is not None:
                return default
            raise KeyError(key) from None


_CANONICAL_TYPES: dict[type, type] = {FastStr: celtypes.StringType, FastMap: celtypes.MapType}


def _cel_type(x: Any) -> Any:
    """``type(x)``, reporting our fast subclasses as the CEL types they stand for."""
    t = celtypes.TypeType(x)
    return _CANONICAL_TYPES.get(t, t)


_RESULT_TEXT: dict[type, str] = {
    ValueError: "return error for overflow",
    TypeError: "no such overload",
    ZeroDivisionError: "divide by zero",
    OverflowError: "return error for overflow",
    IndexError: "invalid_argument",
}


def _result(activation: Any, expr: Callable[[Any], Any]) -> Any:
    """celpy.evaluation.result without its per-call debug logging (same error mapping)."""
    try:
        return expr(activation)
    except (
        ValueError,
        KeyError,
        TypeError,
        ZeroDivisionError,
        OverflowError,
        IndexError,
        NameError,
    ) as ex:
        if isinstance(ex, KeyError):
            text = f"no such member in mapping: {ex.args[0]!r}"
        elif isinstance(ex, NameError):
            text = f"undeclared reference to {ex.args[0]!r}"
        else:
            text = _RESULT_TEXT.get(type(ex)) or next(
                (v for k, v in _RESULT_TEXT.items() if isinstance(ex, k)), "evaluation error"
            )
        err = CELEvalError(text, ex.__class__, ex.args)
        err.__cause__ = ex
        return err


def _has(activation: Any, expr: Callable[[Any], Any]) -> celtypes.BoolType:
    """``has(e.f)`` as a CEL bool (celpy's transpiled form yields a Python bool, which its own
    ``!``, ``&&`` and ``||`` then reject)."""
    found = not isinstance(_result(activation, expr), CELEvalError)
    return _CEL_TRUE if found else _CEL_FALSE


def _as_cel_bool(x: Any) -> Any:
    return (_CEL_TRUE if x else _CEL_FALSE) if type(x) is bool else x


def _logical_not(x: Any) -> Any:
    return celtypes.logical_not(_as_cel_bool(x))


def _logical_and(x: Any, y: Any) -> Any:
    x, y = _as_cel_bool(x), _as_cel_bool(y)
    if isinstance(x, CELEvalError) and not isinstance(y, celtypes.BoolType):
        return x  # both sides failed: report the first error, as cel-go does
    return celtypes.logical_and(x, y)


def _logical_or(x: Any, y: Any) -> Any:
    x, y = _as_cel_bool(x), _as_cel_bool(y)
    if isinstance(x, CELEvalError) and not isinstance(y, celtypes.BoolType):
        return x
    return celtypes.logical_or(x, y)


_HAS_RE = re.compile(
    r"not isinstance\(celpy\.evaluation\.result\(activation, (ex_\d+_h)\), CELEvalError\)"
)


class _EvalGlobals:
    """Globals for exec'ing transpiled rules: celpy's evaluation module plus our extensions.

    Transpiled code reaches celpy through ``celpy.evaluation.X`` / ``celpy.celtypes.X``; the
    ``celpy`` seen here is a private view where the comparison helpers are wrapped once instead
    of on every call and int literals skip a per-call decorator (2-3x faster rules). The real
    celpy modules are not modified.
    """

    base: dict[str, Any] | None = None

    @classmethod
    def new(cls) -> dict[str, Any]:
        if cls.base is None:
            ev = types.ModuleType("_kubeemu_celpy_evaluation")
            ev.__dict__.update(_celev.__dict__)
            for name, op in (
                ("bool_lt", operator.lt),
                ("bool_le", operator.le),
                ("bool_gt", operator.gt),
                ("bool_ge", operator.ge),
                ("bool_eq", operator.eq),
                ("bool_ne", operator.ne),
            ):
                setattr(ev, name, _celev.boolean(op))
            ev.result = _result  # type: ignore[attr-defined]
            ct = types.ModuleType("_kubeemu_celpy_celtypes")
            ct.__dict__.update(celtypes.__dict__)
            ct.IntType = _fast_int  # type: ignore[attr-defined]
            ct.logical_not = _logical_not  # type: ignore[attr-defined]
            ct.logical_and = _logical_and  # type: ignore[attr-defined]
            ct.logical_or = _logical_or  # type: ignore[attr-defined]
            ct.TypeType = _cel_type  # type: ignore[attr-defined]
            g = dict(_celev.__dict__)
            g["celpy"] = types.SimpleNamespace(evaluation=ev, celtypes=ct)
            g[EXT_MODULE] = EXT_NS
            g["_kubeemu_has"] = _has
            cls.base = g
        return dict(cls.base)


class _Activation:
    """Variables for one evaluation; celpy's transpiled code only needs these members."""

    __slots__ = ("_parent", "_vars")

    def __init__(self, variables: dict[str, Any], parent: _Activation | None = None) -> None:
        self._vars = variables
        self._parent = parent

    def __getattr__(self, name: str) -> Any:
        act: _Activation | None = self
        while act is not None:
            v = act._vars
            if name in v:
                return v[name]
            act = act._parent
        fn = _celev.base_functions.get(name)  # type names such as ``int`` in ``type(x) == int``
        if fn is not None:
            return fn
        raise NameError(name)

    get = __getattr__

    def resolve_variable(self, name: str) -> Any:
        return self.__getattr__(name)

    def nested_activation(self, annotations: Any = None, vars: Any = None) -> _Activation:
        return _Activation(dict(vars or {}), self)


class CelParser:
    """One LALR parser for celpy's grammar producing the tree class its transpiler needs.

    celpy caches a single parser class-wide with whatever tree class the first Environment
    asked for; building our own keeps the transpiler working whatever else uses celpy.
    """

    _lark: lark.Lark | None = None
    _lock = threading.Lock()
    # What celpy's runners read from an Environment (package, annotations); building a real
    # Environment would build celpy's own parser too, a second 0.3 s for nothing.
    env = types.SimpleNamespace(package=None, annotations=dict(celpy.googleapis))

    @classmethod
    def get(cls) -> lark.Lark:
        with cls._lock:
            if cls._lark is None:
                grammar = (Path(celpy.__file__).parent / "cel.lark").read_text()
                cls._lark = lark.Lark(
                    grammar,
                    parser="lalr",
                    start="expr",
                    g_regex_flags=re.M,
                    lexer_callbacks={"IDENT": CELParser.ambiguous_literals},
                    propagate_positions=True,
                    maybe_placeholders=False,
                    priority="invert",
                    tree_class=_celev.TranspilerTree,
                )
            return cls._lark


class CelProgram:
    """A CEL expression compiled once: parsed, checked for supported functions, transpiled."""

    def __init__(self, source: str, where: str, check: Callable[[Any], None] | None = None) -> None:
        parser = CelParser.get()
        try:
            ast = parser.parse(source)
        except lark.exceptions.UnexpectedInput as ex:
            raise CRDSchemaError(
                f"{where}: compilation failed: {ex.get_context(source).rstrip()}"
            ) from ex
        if check is not None:
            check(ast)  # e.g. the fields a rule selects exist in its schema
        self.idents: set[str] = set()
        for node in ast.iter_subtrees():
            if node.data == "member_dot_arg":
                tok = node.children[1]
                name = tok.value
                if name in _MACROS:
                    continue
                if name == "min" and len(node.children) == 2:
                    # celpy treats ``min`` as a two-argument macro; Kubernetes' lists library
                    # means ``list.min()``. Route it to our function.
                    node.children[1] = lark.Token("IDENT", "_k8s_min")
                    continue
                if name not in _SUPPORTED:
                    raise CRDSchemaError(
                        f"{where}: compilation failed: function {name!r} is not supported by "
                        f"the emulator (supported: {_SUPPORTED_TEXT})"
                    )
            elif node.data == "ident_arg":
                name = node.children[0].value
                if name not in _FUNC_MACROS and name not in _SUPPORTED:
                    raise CRDSchemaError(
                        f"{where}: compilation failed: function {name!r} is not supported by "
                        f"the emulator (supported: {_SUPPORTED_TEXT})"
                    )
            elif node.data == "dot_ident_arg":
                raise CRDSchemaError(
                    f"{where}: compilation failed: qualified function calls "
                    "are not supported by the emulator"
                )
            elif node.data == "ident":
                self.idents.add(node.children[0].value)
        try:
            runner = celpy.CompiledRunner(CelParser.env, ast, _FUNCTIONS)  # type: ignore[arg-type]
        except Exception as ex:  # celpy reports transpilation problems with various types
            raise CRDSchemaError(f"{where}: compilation failed: {ex}") from ex
        source_text = _HAS_RE.sub(r"_kubeemu_has(activation, \1)", runner.tp.source_text)  # type: ignore[attr-defined]
        self.code = compile(source_text, f"<cel {where}>", "exec")
        self.source = source
        self._globals = _EvalGlobals.new()

    def run(self, variables: dict[str, Any]) -> Any:
        """Evaluate; returns the CEL value or a CELEvalError (never raises for CEL errors)."""
        g = self._globals
        g["base_activation"] = _Activation(variables)
        try:
            exec(self.code, g)
        except Exception as ex:  # an error outside celpy's checked-exception wrapper
            return CELEvalError(str(ex), type(ex), ex.args)
        return g["CEL"]


def eval_error_text(err: CELEvalError) -> str:
    """A celpy evaluation error in cel-go's words (as seen in apiserver messages)."""
    args = err.args
    msg = str(args[0]) if args else "evaluation error"
    cls = args[1] if len(args) > 1 else None
    exargs = args[2] if len(args) > 2 and isinstance(args[2], tuple) else ()
    if cls is CELEvalError and exargs:  # wrapped by celpy's runner
        return eval_error_text(CELEvalError(*exargs))
    if cls is KeyError:
        return f"no such key: {exargs[0] if exargs else msg}"
    if cls is ZeroDivisionError:
        return "division by zero"
    if cls is IndexError:
        detail = str(exargs[0]) if exargs else ""
        return "index out of bounds" + (f": {detail}" if detail.startswith("index") else "")
    if cls is TypeError or msg.startswith("no such overload"):
        return "no such overload"
    if cls is NameError:
        return f"undeclared reference to '{exargs[0] if exargs else msg}'"
    if msg == "return error for overflow":
        detail = str(exargs[0]) if exargs else ""
        return "integer overflow" if detail in ("", "overflow") else detail
    return msg
