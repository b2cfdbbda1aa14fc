"""fmeg's packages import downward only, and fmeg/models keeps one direction (STYLE.md,
"Dependencies point down"): no two of its modules import each other, directly or through others,
counting imports inside functions; the attention variants, experts and the dense MLP sit below the
GPT that composes them, and multi-token prediction and the pipeline split above it."""

import ast
from pathlib import Path

FMEG = Path(__file__).resolve().parent.parent / "fmeg"
MODELS = FMEG / "models"

# fmeg's packages (and top-level modules), lowest first: each may import only those before it.
LAYERS = (
    "tree",
    "ops",
    "fp8",
    "parallel",
    "models",
    "optim",
    "state",
    "data",
    "checkpoint",
    "inference",
    "interop",
    "log_line",
    "cli",
    "config",
    "training",
    "launch",
    "testing",
    "check",
)


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


def packages_imported(path: Path) -> set[str]:
    """The fmeg packages or top-level modules a file imports anywhere in it, its own excluded."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("fmeg")
        ):
            names = (
                [f"fmeg.{a.name}" for a in node.names] if node.module == "fmeg" else [node.module]
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("fmeg.")}
    return out & set(LAYERS)


def test_every_fmeg_package_imports_only_those_below_it():
    """Counting imports inside functions: no package reaches up, so no two packages import each
    other."""
    assert {
        p.stem if p.is_file() else p.name
        for p in FMEG.iterdir()
        if p.suffix == ".py" and p.stem != "__init__" or p.is_dir() and (p / "__init__.py").exists()
    } == set(LAYERS), "a package of fmeg/ is missing from LAYERS"
    upward = []
    for path in sorted(FMEG.rglob("*.py")):
        parts = path.relative_to(FMEG).with_suffix("").parts
        if parts == ("__init__",):
            continue
        mine = parts[0]
        for other in sorted(packages_imported(path) - {mine}):
            if LAYERS.index(other) > LAYERS.index(mine):
                upward.append(f"{path.relative_to(FMEG.parent)} imports fmeg.{other}")
    assert upward == [], "imports that point up:\n" + "\n".join(upward)


def test_the_namespace_stays_in_the_config_package():
    """Outside fmeg/config no module of fmeg imports argparse, except the one-line parser class
    (fmeg/cli.py) and the reading and writing of Megatron-LM's own pickled args
    (fmeg/interop/megatron); the runner takes its RunConfig from fmeg.config.load."""
    allowed = {
        FMEG / "cli.py",
        *FMEG.joinpath("config").rglob("*.py"),
        *FMEG.joinpath("interop", "megatron").rglob("*.py"),
    }
    runner = FMEG.parent / "recipes" / "gpt_pretrain.py"
    found = []
    for path in sorted([*FMEG.rglob("*.py"), runner]):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
                found.append(str(path.relative_to(FMEG.parent)))
            if isinstance(node, ast.ImportFrom) and node.module in (
                "argparse",
                "fmeg.config.arguments",
            ):
                found.append(str(path.relative_to(FMEG.parent)))
    assert found == [], found
