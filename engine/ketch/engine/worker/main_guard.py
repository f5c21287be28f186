"""A clear error for the script that starts worker processes without a ``__main__`` guard.

Worker processes are started with ``spawn``: each one runs a fresh interpreter that imports the
user's script again (as ``__mp_main__``) before it runs the worker. A script that calls
``LLM(tensor_parallel_size=2)`` at module level therefore calls it again in every worker, which
tries to start processes of its own during its bootstrap; Python refuses, the worker exits with
code 1, and all the parent could say was "the worker process of tensor-parallel rank 0 exited
(exit code 1) during start".

``check_main_guard`` looks before anything is started: it finds the module-level line of the main
script that led to this call and, when that line is not inside ``if __name__ == "__main__":``,
raises with what to do. When the script's source cannot be read it says nothing (the check must
never refuse a correct program). In a worker that is re-importing an unguarded script the same
message is raised there too, so it is what the worker's stderr shows.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import sys
import types

ADVICE = (
    "{what} starts worker processes with 'spawn', which imports your script {script} again in "
    "each of them; the call at line {line} is not inside an 'if __name__ == \"__main__\":' "
    "block, so every worker would run it again. Put the code that creates the LLM (and "
    "everything after it) under 'if __name__ == \"__main__\":', e.g.\n\n"
    "    def main():\n        llm = LLM(...)\n        ...\n\n"
    '    if __name__ == "__main__":\n        main()\n'
)


class UnguardedMainError(RuntimeError):
    """The main script would start worker processes again in every worker."""


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(mains) == 1


@functools.lru_cache(maxsize=8)
def _guarded_ranges(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of the top-level ``if __name__ == "__main__":`` bodies of ``path``; None
    when its source cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    ranges = []
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return tuple(ranges)


def _module_frame(main: types.ModuleType) -> types.FrameType | None:
    """The frame running ``main``'s module-level code on this thread's stack, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame
        frame = frame.f_back
    return None


def unguarded_line(main: types.ModuleType | None = None) -> tuple[str, int] | None:
    """``(script, line)`` when the module-level line of the main script on this stack is not
    under a ``__main__`` guard; None when there is no such script or it is guarded."""
    main = main if main is not None else sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return None  # interactive, -c, an embedding program: spawn imports nothing again
    frame = _module_frame(main)
    if frame is None:
        return None  # called from a thread, a callback or another module's code
    ranges = _guarded_ranges(path)
    if ranges is None:
        return None
    line = frame.f_lineno
    if any(start <= line <= end for start, end in ranges):
        return None
    return path, line


def check_main_guard(what: str) -> None:
    """Raises ``UnguardedMainError`` naming the script and line (see the module doc)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # this is a spawned process still importing the main script: the parent's check could
        # not see the line; say the same here, where the worker's stderr shows it
        main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
        script = getattr(main, "__file__", "the main module")
        raise UnguardedMainError(ADVICE.format(what=what, script=script, line="?"))
    found = unguarded_line()
    if found is not None:
        script, line = found
        raise UnguardedMainError(ADVICE.format(what=what, script=script, line=line))
