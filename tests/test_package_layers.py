"""The package's import arrows run one way: no circle among module-level imports, no import (lazy ones included)
from a lower layer to a higher one, the data package free of the model side and the objectives, and
`import naflexclip` loading the core and the model side only."""

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
    "models": {"window"},
    "data": {"core"},
    "objectives": {"models", "parallel", "data"},
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
    if top in ("models", "families", "__init__"):
        return "models"
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


def imports(path: Path) -> list[tuple[str, bool]]:
    """`(imported module, at module level)` for every naflexclip import in the file."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks are not imports at run time
        if isinstance(node, ast.If):
            top_level |= {id(n) for n in node.body}
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
                found.append((target, id(node) in top_level))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names
                      if alias.name.startswith("naflexclip")]
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_no_import_goes_up_a_layer():
    upward = [f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)})"
              for name, targets in GRAPH.items() for target, _ in targets
              if layer_of(target) not in allowed(layer_of(name))]
    assert not upward, "\n".join(sorted(set(upward)))


def test_the_data_package_imports_neither_the_model_side_nor_the_objectives():
    wrong = [f"{name} imports {target}" for name, targets in GRAPH.items() if name.startswith("naflexclip.data")
             for target, _ in targets if layer_of(target) not in ("core", "data")]
    assert not wrong, "\n".join(wrong)


def test_module_level_imports_have_no_circle():
    graph = {name: {t for t, top in targets if top and t in MODULES and t != name} for name, targets in GRAPH.items()}
    # a package's __init__ importing its own submodules is how re-exports work, not a circle through the design
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt]
                if not all(c == cycle[0] or c.startswith(cycle[0] + ".") or cycle[0].startswith(c + ".")
                           for c in cycle):
                    circles.append(" -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)


def test_no_two_files_share_a_name():
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert not {k: v for k, v in names.items() if len(v) > 1}


def test_the_layer_checks_catch_an_upward_import(tmp_path):
    """Teeth: a data module importing an objective, and a circle, are found."""
    assert layer_of("naflexclip.objectives.locca_decoder") not in allowed(layer_of("naflexclip.data.regions"))
    assert layer_of("naflexclip.train.loop") not in allowed(layer_of("naflexclip.families.factory"))
    assert layer_of("naflexclip.data.loader") not in allowed(layer_of("naflexclip.models.naflex_clip"))


@pytest.mark.parametrize("entry", ["naflexclip"])
def test_import_naflexclip_loads_the_core_and_the_model_side_only(entry):
    code = (f"import sys, {entry}\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('naflexclip')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    above = sorted(m for m in loaded if layer_of(m) not in allowed("models"))
    assert not above, above
