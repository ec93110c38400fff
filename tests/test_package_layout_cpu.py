"""The package's design rules, checked from the sources' syntax trees.

- No module imports another module's private names, or reads or writes a private
  attribute that its own code does not define.
- Imports point down the layers of :data:`LAYERS`: never from a lower layer to a
  higher one.
- No import cycle between modules, counting every import: at load time, under
  ``if TYPE_CHECKING:`` and inside functions.

A package's ``__init__`` importing its own submodules is how a package exports, and is
not a cycle. Private names of torch and of the standard library are reached through
:mod:`cudagraphs.torch_private`, or through the few sites listed in
:data:`FOREIGN_PRIVATE_ATTRIBUTES`, each with why it cannot be avoided.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import cudagraphs

SRC = Path(cudagraphs.__file__).parent

# mutmut's copies of the sources carry its trampolines: the rules hold for the sources.
pytestmark = pytest.mark.skipif("mutants" in SRC.parts, reason="mutmut's copy of the sources")

# Layer rank of every module, by the longest matching dotted prefix; a higher rank
# may import a lower or equal one. DESIGN.md's map: the base modules, the capture
# primitives, the core and programs beside it, the layers on them, the integrations,
# and the package's front door.
LAYERS: dict[str, int] = {
    "cudagraphs.errors": 0,
    "cudagraphs.dtypes": 0,
    "cudagraphs.forward_swap": 0,
    "cudagraphs.capture_state": 0,
    "cudagraphs.diagnostics": 0,
    "cudagraphs.hf_masks": 0,
    "cudagraphs.settings": 0,
    "cudagraphs.torch_private": 0,
    "cudagraphs.checks": 0,
    "cudagraphs.models": 0,
    "cudagraphs.timing": 0,
    "cudagraphs.moe_kernels": 0,
    "cudagraphs.cuda_binding": 1,
    "cudagraphs.graph_pool": 1,
    "cudagraphs.memory": 1,
    "cudagraphs.optimizer_state": 1,
    "cudagraphs.capture": 1,
    "cudagraphs.introspect": 1,
    "cudagraphs.compile_watch": 1,
    "cudagraphs.core": 2,
    "cudagraphs.program": 2,
    "cudagraphs.stacking": 2,
    "cudagraphs.serving": 3,
    "cudagraphs.train": 3,
    "cudagraphs.partial": 4,
    "cudagraphs.integrations": 5,
    "cudagraphs": 6,
}

# Private attributes of other projects' objects that the package reads, by module.
# Each is public in practice and has no public spelling in the torch versions
# supported (2.11 and newer).
FOREIGN_PRIVATE_ATTRIBUTES: dict[str, set[str]] = {
    # torch's storage seam: a storage's C++ handle for its use count, and the exchange
    # of two storages' memory (owned gradients moved off graph memory on demand).
    # A view's base tensor, which holds the same storage.
    "cudagraphs.torch_private": {"_cdata", "_swap_data_ptr_", "_base"},
    # The caller's frame, to name the line of a user's call in a warning.
    "cudagraphs.hf_masks": {"_getframe"},
    # Every child slot of a module, a module registered twice included (named_children
    # yields it once; target selection must see it and refuse it).
    "cudagraphs.partial.tree": {"_modules"},
    # BatchNorm and its relatives share this base; isinstance is the public check.
    "cudagraphs.partial.scopes": {"_NormBase"},
    # namedtuple's field names (its documented API spells them with an underscore).
    "cudagraphs.program.containers": {"_fields"},
    # transformers builds its logits processors through this method only.
    "cudagraphs.serving.hf.sampling": {"_get_logits_processor"},
}


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    # Dotted package modules imported anywhere in the file.
    imports: set[str] = field(default_factory=set)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _load() -> dict[str, Module]:
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        name = _module_name(path)
        modules[name] = Module(name, path, ast.parse(path.read_text()), path.name == "__init__.py")
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(module, node)
                if target.split(".")[0] != "cudagraphs":
                    continue
                # `from . import x` and `from .pkg import mod` may name submodules; a
                # statement that imports only submodules does not import the package.
                submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                module.imports.update(submodules)
                if len(submodules) < len(node.names):
                    module.imports.add(target)
            elif isinstance(node, ast.Import):
                module.imports.update(
                    a.name for a in node.names if a.name.split(".")[0] == "cudagraphs"
                )
        module.imports &= modules.keys()
        module.imports.discard(module.name)
    return modules


def _layer(name: str) -> int:
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Every name the module itself defines or binds, attributes included."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias) and not node.name.startswith("cudagraphs"):
            # `import torch._dynamo as d` binds `d`; the private part is torch's.
            names.add((node.asname or node.name).split(".")[0])
    return names


def private_name_imports(modules: dict[str, Module]) -> list[str]:
    found = []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(module, node)
                if target.split(".")[0] != "cudagraphs":
                    continue
                found += [
                    f"{module.name}:{node.lineno} imports {a.name} from {target}"
                    for a in node.names
                    if _private(a.name)
                ]
    return found


def private_attribute_reads(modules: dict[str, Module]) -> list[str]:
    found = []
    for module in modules.values():
        own = _own_names(module.tree) | FOREIGN_PRIVATE_ATTRIBUTES.get(module.name, set())
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                continue  # torch's privates: checked by tests/test_torch_private_cpu.py
            if node.attr in own:
                continue
            verb = "writes" if isinstance(node.ctx, ast.Store) else "reads"
            found.append((module.name, node.lineno, f"{verb} {ast.unparse(node)}"))
    return [f"{name}:{line} {what}" for name, line, what in sorted(found)]


def upward_imports(modules: dict[str, Module]) -> list[str]:
    return [
        f"{m.name} (layer {_layer(m.name)}) imports {t} (layer {_layer(t)})"
        for m in modules.values()
        for t in sorted(m.imports)
        if _layer(t) > _layer(m.name)
    ]


def import_cycles(modules: dict[str, Module]) -> list[list[str]]:
    edges = {
        m.name: {t for t in m.imports if not (m.is_package and t.startswith(m.name + "."))}
        for m in modules.values()
    }
    state: dict[str, str] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
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
    return cycles


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return _load()


def test_no_module_imports_another_modules_private_names(modules):
    found = private_name_imports(modules)
    assert found == [], "make the name public where it is defined, or move the code:\n" + (
        "\n".join(found)
    )


def test_no_module_touches_another_modules_private_attributes(modules):
    found = private_attribute_reads(modules)
    assert found == [], (
        "a private attribute used outside the module that defines it (give it a public "
        "name there, or move the code):\n" + "\n".join(found)
    )


def test_imports_point_down_the_layers(modules):
    found = upward_imports(modules)
    assert found == [], "a lower layer imports a higher one:\n" + "\n".join(found)


def test_no_import_cycles_of_any_kind(modules):
    cycles = import_cycles(modules)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer(modules):
    # The catch-all "cudagraphs" entry is the front door: a new subpackage must say
    # where it sits instead of landing at the top by accident.
    unplaced = [
        name
        for name in modules
        if name.count(".") >= 1
        and max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
        == "cudagraphs"
        and name
        not in {
            "cudagraphs.__main__",
            "cudagraphs.demos",
            "cudagraphs.envinfo",
            "cudagraphs.pytest_plugin",
        }
    ]
    assert unplaced == [], f"modules without a layer in LAYERS: {unplaced}"


# The checkers themselves, on small trees written here: each rule must see what it
# is for, in every form of import.


def _tree(tmp_sources: dict[str, str]) -> dict[str, Module]:
    modules = {}
    for name, text in tmp_sources.items():
        is_package = name.endswith(".__init__")
        dotted = name.removesuffix(".__init__")
        modules[dotted] = Module(dotted, Path(name), ast.parse(text), is_package)
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(module, node)
                module.imports.add(target)
                module.imports.update(f"{target}.{a.name}" for a in node.names)
        module.imports &= modules.keys()
        module.imports.discard(module.name)
    return modules


def test_the_cycle_finder_counts_type_checking_and_function_imports():
    tree = _tree(
        {
            "cudagraphs.core.a": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .b import B\n",
            "cudagraphs.core.b": "def f():\n    from .a import A\n",
            "cudagraphs.core.__init__": "from .a import A\nfrom .b import B\n",
        }
    )
    assert import_cycles(tree) == [["cudagraphs.core.a", "cudagraphs.core.b", "cudagraphs.core.a"]]


def test_the_layer_rule_sees_an_upward_import():
    tree = _tree({"cudagraphs.core.a": "from ..serving.x import y\n", "cudagraphs.serving.x": ""})
    assert upward_imports(tree) == [
        "cudagraphs.core.a (layer 2) imports cudagraphs.serving.x (layer 3)"
    ]


def test_the_private_rules_see_names_and_attributes():
    tree = _tree(
        {
            "cudagraphs.core.a": "from .b import _hidden\n",
            "cudagraphs.core.b": "def use(runner):\n    runner._replay()\n    runner._state = 1\n",
            "cudagraphs.core.c": "class C:\n    def __init__(self):\n        self._n = 0\n"
            "    def same(self, other):\n        return other._n == self._n\n",
        }
    )
    assert private_name_imports(tree) == [
        "cudagraphs.core.a:1 imports _hidden from cudagraphs.core.b"
    ]
    assert private_attribute_reads(tree) == [
        "cudagraphs.core.b:2 reads runner._replay",
        "cudagraphs.core.b:3 writes runner._state",
    ]


def test_the_checks_read_the_real_package(modules):
    assert "cudagraphs.cuda_binding" in modules["cudagraphs.program.staging"].imports
    assert "cudagraphs.program.launch_order" in modules["cudagraphs.program.pool"].imports
