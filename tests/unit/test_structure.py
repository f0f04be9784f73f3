"""The tree keeps its plan: train/config and train/core import no wing, core holds only what every strategy uses,
no import circle between modules (issues #12, #39)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

TRAIN = REPO / "train"
WINGS = ("exchange", "diloco", "edt", "evomerge", "merge", "launch", "status")


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every train.* module this file imports, at top level or inside a function (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("train.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("train"):
            for a in node.names:  # `from train.core import store` names a module, `from train.core.store import x` not
                sub = f"{node.module}.{a.name}"
                out.add(sub if (TRAIN.parent / (sub.replace(".", "/") + ".py")).is_file() else node.module)
    return {m for m in out if m != "train"}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in TRAIN.rglob("*.py")}


def test_core_imports_no_wing():
    bad = {m: sorted(i for i in deps if i.split(".")[1] in WINGS)
           for m, deps in graph().items() if m.startswith("train.core.")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_config_imports_only_core_errors_and_the_recipe_reader():
    """train/config is the bottom layer: its own modules, train.core.errors, EvoMerge's recipe reader (lazily,
    when evomerge.initial_recipe names a mergekit YAML) and the object store's URL-to-mirror mapping (lazily, for an
    s3:// base_dir; train.core.objstore imports nothing of train at its top)."""
    allowed = {"train.core.errors", "train.evomerge.recipe", "train.core.objstore"}
    bad = {m: sorted(d for d in deps if not d.startswith("train.config") and d not in allowed)
           for m, deps in graph().items() if m.startswith("train.config")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_core_holds_no_configuration_and_no_strategy_modules():
    """The config package owns the configuration; each strategy owns its layout, outer step and genes (issue #39)."""
    names = sorted(p.stem for p in (TRAIN / "core").glob("*.py"))
    assert not [n for n in names if n.startswith("config")], names
    assert not {"outer", "evolution", "strategies"} & set(names), names
    common = (TRAIN / "core" / "store.py").read_text().split("class RunPaths", 1)[1].split("\n\n\n")[0]
    assert "rounds = property" not in common and "def delta_file" not in common  # DiLoCo's: train/exchange/store.py


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if d not in g:
                continue
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_train_has_no_flat_modules_but_the_package_marker():
    flat = sorted(p.name for p in TRAIN.glob("*.py") if p.name != "__init__.py")
    assert not flat, (f"modules belong in a subpackage (config, core, exchange, diloco, edt, evomerge, merge, "
                      f"launch, status): {flat}")
