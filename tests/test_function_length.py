"""No function in dflash_cli/ has a body over 80 lines (issue 57): longer ones get split into named steps.

The body is counted from its first statement after the docstring to its last line; the signature and the
docstring do not count. Modules are read with `ast`, never imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_cli"
MAX_BODY_LINES = 80

ALLOWED: set[str] = set()  # "path.py:function" of a function being split, while it is


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def long_functions(package: Path = PACKAGE) -> dict[str, int]:
    """ "path/relative/to/package.py:function" -> body lines, for every function over the limit."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = body_lines(node)
                if lines > MAX_BODY_LINES:
                    found[f"{path.relative_to(package).as_posix()}:{node.name}"] = lines
    return found


def test_no_function_body_is_over_80_lines() -> None:
    over = {name: lines for name, lines in long_functions().items() if name not in ALLOWED}
    assert not over, f"function bodies over {MAX_BODY_LINES} lines (split them into named steps): {over}"


def test_the_count_skips_the_signature_and_the_docstring() -> None:
    source = (
        'def f(\n    a,\n    b,\n):\n    """Doc.\n\n    More.\n    """\n    x = a\n    return (\n        x + b\n    )\n'
    )
    assert body_lines(ast.parse(source).body[0]) == 4
