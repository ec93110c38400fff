"""The test suite's own layout rules (issue 38), checked from the syntax trees of every
file under ``tests/``:

- No module imports a test module (``test_*.py``), at load time or inside a function:
  shared plain helpers live in the ``tests/helpers`` package, shared fixtures in the
  folder's ``conftest.py``.
- A ``test_*.py`` file is named ``test_cuda_*.py`` if and only if every test in it is
  marked ``cuda`` (the module's ``pytestmark`` or a ``pytest.mark.cuda`` decorator);
  every other one is named ``test_*_cpu.py`` and marks no test ``cuda``.
- No ``tests/_*.py`` module exists or is imported: the helpers live in
  ``tests/helpers/``.

Each rule reports every offender at once.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Source:
    path: Path
    tree: ast.Module

    @property
    def where(self) -> str:
        return self.path.relative_to(TESTS.parent).as_posix()


def sources() -> list[Source]:
    return [
        Source(path, ast.parse(path.read_text(), filename=str(path)))
        for path in sorted(TESTS.rglob("*.py"))
    ]


SOURCES = sources()
TEST_MODULES = {s.path.stem for s in SOURCES if s.path.name.startswith("test_")}
TOP_LEVEL_PRIVATE = {p.stem for p in TESTS.glob("_*.py") if p.name != "__init__.py"}


def imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``tree``, nested ones included; for a
    relative ``from . import x`` the names imported count as modules too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                found.append((node.lineno, node.module))
            if node.level or not node.module:
                found += [(node.lineno, alias.name) for alias in node.names]
    return found


def is_cuda_mark(node: ast.expr) -> bool:
    """``pytest.mark.cuda`` or ``mark.cuda``, called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    if not (isinstance(node, ast.Attribute) and node.attr == "cuda"):
        return False
    owner = node.value
    if isinstance(owner, ast.Name):
        return owner.id == "mark"
    return (
        isinstance(owner, ast.Attribute)
        and owner.attr == "mark"
        and isinstance(owner.value, ast.Name)
        and owner.value.id == "pytest"
    )


def marks_cuda(value: ast.expr) -> bool:
    """Whether a ``pytestmark`` value (one mark, or a list or tuple of them) holds cuda."""
    if isinstance(value, ast.List | ast.Tuple):
        return any(is_cuda_mark(v) for v in value.elts)
    return is_cuda_mark(value)


def module_marks_cuda(tree: ast.Module) -> bool:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        named = any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets)
        if named and node.value is not None and marks_cuda(node.value):
            return True
    return False


def collected_tests(tree: ast.Module) -> list[tuple[str, bool]]:
    """(name, marked cuda by a decorator of its own or of its class) of every test."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            found.append((node.name, any(is_cuda_mark(d) for d in node.decorator_list)))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            on_class = any(is_cuda_mark(d) for d in node.decorator_list) or any(
                isinstance(s, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
                and marks_cuda(s.value)
                for s in node.body
            )
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                    item.name.startswith("test")
                ):
                    cuda = on_class or any(is_cuda_mark(d) for d in item.decorator_list)
                    found.append((f"{node.name}.{item.name}", cuda))
    return found


def any_cuda_mark(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.expr) and is_cuda_mark(n) for n in ast.walk(tree))


def naming_offence(source: Source) -> str | None:
    name = source.path.name
    if not name.startswith("test_"):
        return None
    tests = collected_tests(source.tree)
    everywhere = module_marks_cuda(source.tree)
    uncuda = [] if everywhere else [t for t, cuda in tests if not cuda]
    if name.startswith("test_cuda_"):
        if not tests:
            return f"{source.where}: named test_cuda_* but holds no test"
        if uncuda:
            return (
                f"{source.where}: named test_cuda_* but {', '.join(uncuda)} not marked "
                "cuda; mark them or move them to a test_*_cpu.py file"
            )
        return None
    if not name.endswith("_cpu.py"):
        kind = "GPU" if tests and not uncuda else "CPU"
        want = f"test_cuda_{name[5:]}" if kind == "GPU" else f"{name[:-3]}_cpu.py"
        return f"{source.where}: a {kind} test file must be named like {want}"
    if any_cuda_mark(source.tree):
        return (
            f"{source.where}: a test_*_cpu.py file marks tests cuda; move them to a "
            "test_cuda_*.py file"
        )
    return None


def test_the_checks_see_the_whole_tree():
    # A walk that found nothing would pass every rule below.
    assert len(TEST_MODULES) > 100
    assert {"test_test_layout_cpu", "test_contract_cpu"} <= TEST_MODULES
    assert any(s.path.parent.name == "helpers" for s in SOURCES)


def test_no_module_imports_a_test_module():
    offenders = [
        f"{s.where}:{line}: imports {name}"
        for s in SOURCES
        for line, name in imported_modules(s.tree)
        if any(part in TEST_MODULES for part in name.split("."))
    ]
    assert not offenders, (
        "test modules import other test modules; move the shared definitions into "
        "tests/helpers/ (plain helpers) or the folder's conftest.py (fixtures):\n"
        + "\n".join(offenders)
    )


def test_each_test_file_is_named_for_where_its_tests_run():
    offenders = [o for o in map(naming_offence, SOURCES) if o is not None]
    assert not offenders, "\n".join(offenders)


def test_no_module_imports_a_private_module_at_the_top_of_tests():
    offenders = [f"tests/{stem}.py exists" for stem in sorted(TOP_LEVEL_PRIVATE)]
    offenders += [
        f"{s.where}:{line}: imports {name}"
        for s in SOURCES
        for line, name in imported_modules(s.tree)
        if name.split(".")[0] in TOP_LEVEL_PRIVATE
    ]
    assert not offenders, (
        "the shared helpers live in the tests/helpers package (from helpers.x import "
        "...), not in tests/_*.py:\n" + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "text, offence",
    [
        ("import pytest\npytestmark = pytest.mark.cuda\ndef test_a(): pass\n", None),
        (
            "import pytest\n@pytest.mark.cuda\ndef test_a(): pass\ndef test_b(): pass\n",
            "test_b not marked cuda",
        ),
        ("import pytest\n", "holds no test"),
    ],
)
def test_a_gpu_file_must_mark_every_test(text, offence):
    source = Source(TESTS / "x" / "test_cuda_x.py", ast.parse(text))
    got = naming_offence(source)
    assert (got is None) if offence is None else (offence in got), got


@pytest.mark.parametrize(
    "name, text, offence",
    [
        ("test_x_cpu.py", "def test_a(): pass\n", None),
        ("test_x.py", "def test_a(): pass\n", "named like test_x_cpu.py"),
        (
            "test_x.py",
            "import pytest\npytestmark = [pytest.mark.cuda]\ndef test_a(): pass\n",
            "named like test_cuda_x.py",
        ),
        (
            "test_x_cpu.py",
            "import pytest\n@pytest.mark.parametrize('a', [pytest.param(1, "
            "marks=pytest.mark.cuda)])\ndef test_a(a): pass\n",
            "marks tests cuda",
        ),
    ],
)
def test_a_cpu_file_is_named_so_and_marks_nothing_cuda(name, text, offence):
    source = Source(TESTS / "x" / name, ast.parse(text))
    got = naming_offence(source)
    assert (got is None) if offence is None else (offence in got), got


def test_imports_inside_functions_and_relative_ones_are_seen():
    tree = ast.parse("import helpers.x\ndef f():\n    from test_a import b\nfrom . import test_c\n")
    assert sorted(imported_modules(tree)) == [(1, "helpers.x"), (3, "test_a"), (4, "test_c")]
