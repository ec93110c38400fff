"""The package's layout rules, checked from the sources: imports point one way (no
module imports, at load time, a module that imports it back) and modules stay small."""

import ast
from pathlib import Path

import pytest

import cudagraphs

SRC = Path(cudagraphs.__file__).parent
# The house rule is "no module over ~400 lines"; this guard fails well before a
# module doubles, and names the offenders.
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(path: Path) -> set[str]:
    """Package modules imported when ``path`` loads: top-level ``import``/``from``
    statements (not those under ``if TYPE_CHECKING:`` or inside functions)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("cudagraphs"):
                found.add(target)
                # `from . import x` / `from .pkg import mod` may name submodules.
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cudagraphs"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: _load_time_imports(p) & modules.keys() for name, p in modules.items()}


def test_no_import_cycles_between_modules():
    graph = _graph()
    # A package's __init__ importing its own submodules is how packages export; a
    # cycle is a submodule importing, at load time, one that imports it back.
    edges = {
        name: {t for t in targets if not name.startswith(t + ".") and t != name}
        for name, targets in graph.items()
    }
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_sees_relative_imports():
    graph = _graph()
    assert "cudagraphs.program.launch_order" in graph["cudagraphs.program.pool"]
    assert "cudagraphs.cuda_binding" in graph["cudagraphs.program.staging"]


@pytest.mark.skipif(
    "mutants" in SRC.parts, reason="mutmut's copies of the sources carry its trampolines"
)
def test_no_module_is_far_over_the_size_rule():
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert too_big == {}, f"modules over {MAX_LINES} lines (split them by topic): {too_big}"
