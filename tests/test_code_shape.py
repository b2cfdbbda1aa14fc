"""The shape the style guide asks of the code: no function in fmeg/ or recipes/ longer than 80
lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 80


def long_functions(max_lines: int = MAX_LINES) -> list[str]:
    """'path:line name (n lines)' for every function or method longer than max_lines."""
    out = []
    for path in sorted(
        [*ROOT.joinpath("fmeg").rglob("*.py"), *ROOT.joinpath("recipes").rglob("*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    out.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
                    )
    return out


def test_no_function_is_longer_than_80_lines():
    assert long_functions() == [], "split these:\n" + "\n".join(long_functions())


def test_the_check_finds_a_long_function():
    assert long_functions(max_lines=60), "no function over 60 lines: the walk finds nothing"


def test_no_test_module_imports_another():
    """Shared helpers live in tests/harness; a test module imports from there, never from another
    test module (function-level imports included)."""
    found = []
    for path in sorted(ROOT.joinpath("tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [
                f"{path.relative_to(ROOT)} imports {n}"
                for n in names
                if n.split(".")[-1].startswith("test_")
            ]
    assert found == [], "\n".join(found)


def test_no_line_is_longer_than_100_characters():
    """ruff's E501 forgives lines that end in a pragma; the style guide does not."""
    long = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("fmeg", "recipes", "tests", "bench")
        for path in sorted(ROOT.joinpath(folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert long == [], long
