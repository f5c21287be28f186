"""A script that starts tensor-parallel workers without ``if __name__ == "__main__":`` gets an
error that says so (issue 28, deliverable 8), and a guarded one runs.

The scripts run as real programs (``python script.py``): the failure only exists where spawn
imports the main script again, which pytest's own main module never triggers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ketch.engine.worker.main_guard import unguarded_line

UNGUARDED = """\
from ketch.engine import LLM, SamplingParams

llm = LLM("tiny", tensor_parallel_size=2, block_size=16, kv_cache_memory="16MiB")
print(llm.generate(["Alice"], SamplingParams(max_tokens=3))[0].outputs[0].text)
"""

GUARDED = """\
from ketch.engine import LLM, SamplingParams


def main() -> None:
    llm = LLM("tiny", tensor_parallel_size=2, block_size=16, kv_cache_memory="16MiB")
    out = llm.generate(["Alice"], SamplingParams(max_tokens=3, temperature=0))
    print("OUTPUT", len(out[0].outputs[0].token_ids))


if __name__ == "__main__":
    main()
"""


def _run(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


def test_unguarded_script_gets_clear_error(tmp_path: Path) -> None:
    done = _run(tmp_path, "unguarded.py", UNGUARDED)
    assert done.returncode != 0
    assert "UnguardedMainError" in done.stderr, done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in done.stderr
    assert "unguarded.py" in done.stderr and "line 3" in done.stderr
    assert "tensor parallelism" in done.stderr
    # refused before any worker started: the old "rank 0 exited (exit code 1)" never appears
    assert "exited (exit code" not in done.stderr


def test_guarded_script_runs(tmp_path: Path) -> None:
    done = _run(tmp_path, "guarded.py", GUARDED)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OUTPUT 3" in done.stdout


def test_guard_detection_cases(tmp_path: Path) -> None:
    """The static check: which module-level lines count as guarded."""
    script = tmp_path / "cases.py"
    script.write_text(
        textwrap.dedent(
            """\
            import sys
            a = 1
            if "__main__" == __name__:
                b = 2
                c = 3
            if __name__ != "__main__":
                d = 4
            """
        )
    )
    main = type(sys)("__main__")
    main.__file__ = str(script)
    namespace = vars(main)

    def line_of(n: int) -> tuple[str, int] | None:
        # run a call at line n of the script as module-level code of ``main``
        code = compile("\n" * (n - 1) + "found = unguarded_line(main)", str(script), "exec")
        namespace.update(unguarded_line=unguarded_line, main=main)
        exec(code, namespace)
        return namespace["found"]

    assert line_of(2) == (str(script), 2)
    assert line_of(4) is None and line_of(5) is None  # under the guard, written either way
    assert line_of(7) == (str(script), 7)  # the negated test is no guard
    main.__file__ = str(tmp_path / "missing.py")
    assert line_of(2) is None  # unreadable source: never refuse
