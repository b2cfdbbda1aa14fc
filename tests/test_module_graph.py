"""fmeg/models keeps one direction (STYLE.md, "Dependencies point down"): no two of its modules import each other,
directly or through others, counting imports inside functions; the attention variants, experts and the dense MLP
sit below the GPT that composes them, and multi-token prediction and the pipeline split above it."""

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "fmeg" / "models"


def imports_of(path: Path) -> set[str]:
    """The fmeg.models modules a file imports anywhere in it (module level or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "fmeg.models":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fmeg.models."):
            out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("fmeg.models.")}
    return out - {path.stem}


def test_the_model_modules_import_one_way():
    graph = {p.stem: imports_of(p) for p in MODELS.glob("*.py") if p.stem != "__init__"}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(m for m in graph if m in reachable(m))
    assert cycles == [], f"fmeg/models modules in an import cycle: {cycles}"
    for below in ("mla", "moe", "mlp", "gpt_config", "vocab"):
        assert not reachable(below) & {"gpt", "mtp", "gpt_pipeline"}, below
    assert not reachable("gpt") & {"mtp", "gpt_pipeline"}
