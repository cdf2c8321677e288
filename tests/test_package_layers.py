"""The package's import arrows run one way. Every import statement counts, at module level or inside a function
(a lazy import is an arrow all the same) or under `if TYPE_CHECKING:`: no circle, no import from a lower layer to
a higher one, the data package free of the model side and the objectives, and `import naflexclip` loading the core
and the model side only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "naflexclip"

# each layer may import itself and the layers it lists (and what those may import, transitively)
LAYERS: dict[str, set[str]] = {
    "core": set(),  # batch, rng, settings, checkpoint storage, processing
    "loss": {"core"},
    "window": {"core", "loss"},
    "parallel": {"window"},
    "models": {"window"},  # our model, plain
    "families": {"models"},  # a family builds our model, and create_model picks a family
    "data": {"core"},
    "objectives": {"families", "parallel", "data"},
    "audit": {"objectives"},
    "evaluation": {"objectives"},
    "train": {"audit", "evaluation"},
    "cli": {"train"},
}
CORE = ("batch", "rng", "checkpoints", "processing", "settings")


def layer_of(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in CORE:
        return "core"
    if top == "__init__":  # `import naflexclip`: create_model and the model's classes
        return "families"
    if top in ("cli", "__main__"):
        return "cli"
    return top


def allowed(layer: str) -> set[str]:
    seen, todo = {layer}, [layer]
    while todo:
        for below in LAYERS[todo.pop()]:
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, name: str, is_package: bool = False) -> list[str]:
    """The naflexclip modules that module `name` (its text `source`) imports, wherever the import statement is."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("naflexclip"):
                continue
            for alias in node.names:  # `from naflexclip.x import y`: y may be a module
                candidate = f"{base}.{alias.name}"
                target = candidate if _is_module(candidate) else base
                found.append(target)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("naflexclip")]
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports(path.read_text(), name, path.name == "__init__.py") for name, path in MODULES.items()}


def upward_imports(graph: dict[str, list[str]]) -> list[str]:
    return sorted({f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)})"
                   for name, targets in graph.items() for target in targets
                   if layer_of(target) not in allowed(layer_of(name))})


def circles(graph: dict[str, list[str]]) -> list[str]:
    """Each circle of imports found by a depth-first walk (one per back edge), as `a -> b -> a`."""
    edges = {name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()}
    state: dict[str, int] = {}
    found = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt]
                # a package's __init__ importing its own submodules is how re-exports work, not a circle
                if not all(c == cycle[0] or c.startswith(cycle[0] + ".") or cycle[0].startswith(c + ".")
                           for c in cycle):
                    found.append(" -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    return found


def test_no_import_goes_up_a_layer():
    upward = upward_imports(GRAPH)
    assert not upward, "\n".join(upward)


def test_the_data_package_imports_neither_the_model_side_nor_the_objectives():
    wrong = [f"{name} imports {target}" for name, targets in GRAPH.items() if name.startswith("naflexclip.data")
             for target in targets if layer_of(target) not in ("core", "data")]
    assert not wrong, "\n".join(wrong)


def test_imports_have_no_circle():
    found = circles(GRAPH)
    assert not found, "\n".join(found)


def test_no_two_files_share_a_name():
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert not {k: v for k, v in names.items() if len(v) > 1}


def test_the_layer_checks_catch_an_upward_import():
    """Teeth: a data module importing an objective, and models importing a family, are upward."""
    assert layer_of("naflexclip.objectives.locca_decoder") not in allowed(layer_of("naflexclip.data.regions"))
    assert layer_of("naflexclip.train.loop") not in allowed(layer_of("naflexclip.families.factory"))
    assert layer_of("naflexclip.data.loader") not in allowed(layer_of("naflexclip.models.naflex_clip"))
    assert layer_of("naflexclip.families.factory") not in allowed(layer_of("naflexclip.models.run_weights"))
    assert layer_of("naflexclip.models.naflex_clip") in allowed(layer_of("naflexclip.families.openclip"))


LAZY_UPWARD = """
from naflexclip.models.naflex_clip import NaFlexClip

def build(name):
    from naflexclip.families import named_family  # lazy: inside a function
    return named_family(name)
"""

LAZY_BACK = """
def schedule():
    from .siglip2_recipe import Recipe
    return Recipe
"""


def test_a_lazy_import_up_a_layer_or_round_a_circle_is_caught():
    """Teeth: the checks see an import inside a function (models importing a family lazily, as models/factory.py
    did; an objective importing back the module that imports it, as self_distill_schedule and siglip2_recipe did)."""
    graph = dict(GRAPH)
    graph["naflexclip.models.synthetic"] = imports(LAZY_UPWARD, "naflexclip.models.synthetic")
    assert upward_imports(graph) == [
        "naflexclip.models.synthetic (models) imports naflexclip.families (families)"]
    graph = dict(GRAPH)
    graph["naflexclip.objectives.self_distill_schedule"] = [
        *GRAPH["naflexclip.objectives.self_distill_schedule"],
        *imports(LAZY_BACK, "naflexclip.objectives.self_distill_schedule")]
    assert circles(graph) == ["naflexclip.objectives.siglip2_recipe -> naflexclip.objectives.self_distill_schedule"
                              " -> naflexclip.objectives.siglip2_recipe"]


@pytest.mark.parametrize("entry", ["naflexclip"])
def test_import_naflexclip_loads_the_core_and_the_model_side_only(entry):
    code = (f"import sys, {entry}\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('naflexclip')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    above = sorted(m for m in loaded if layer_of(m) not in allowed("families"))
    assert not above, above
