"""The README and the pages under ``docs/``: the README stays a guide (at most 250
lines), every link to a result file or another page points at something that exists,
prose carries no commit hashes or run numbers (those live in the result files and
``benchmarks/RESULTS.md``), and the names the examples import exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# Pages whose links are checked: the guide, the reference, and the generated results.
LINKED = [*PAGES, REPO / "benchmarks" / "RESULTS.md", REPO / "benchmarks" / "README.md"]
MAX_README_LINES = 250

_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`]*`")


def _name(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``."""
    text = heading.strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _links(path: Path) -> list[str]:
    return [m["target"] for m in _LINK.finditer(_FENCE.sub("", path.read_text()))]


def test_the_readme_is_a_guide_of_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move reference to "
        "the layer's page under docs/ and numbers to the result files"
    )


@pytest.mark.parametrize("page", LINKED, ids=_name)
def test_every_relative_link_points_at_a_file_that_exists(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {_name(dest)}")
    assert broken == [], f"{_name(page)}: " + "; ".join(broken)


def test_the_readme_links_every_layer_page_and_the_results():
    targets = {t.partition("#")[0] for t in _links(README)}
    for page in DOCS:
        assert f"docs/{page.name}" in targets, f"README.md does not link docs/{page.name}"
    assert "benchmarks/RESULTS.md" in targets
    results = [t for t in targets if t.startswith("benchmarks/results/")]
    assert results, "README.md quotes no result file"


# A commit hash: 7 to 40 hex digits with at least one digit and one letter.
_HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
_RUN = re.compile(r"\bruns? \d+\b|\brun\d+\b", re.I)


def _prose(path: Path) -> str:
    """A page without its code blocks and without link targets (result files are named
    after their commit and run)."""
    text = _FENCE.sub("", path.read_text())
    return _LINK.sub(lambda m: "" if "results/" in m["target"] else m["text"], text)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_prose_names_no_commit_and_no_run(page):
    text = _prose(page)
    # A run label in code (`--run-label run2`) is an option's value, not a run quoted.
    found = sorted(set(_HASH.findall(text)) | set(_RUN.findall(_CODE.sub("", text))))
    assert found == [], (
        f"{_name(page)} names commits or runs in its prose: {found}; link the result "
        "file instead (benchmarks/results/, listed in benchmarks/RESULTS.md)"
    )


_IMPORT = re.compile(r"^\s*from (cudagraphs[\w.]*) import ([^\n#]+)", re.M)


def _imports() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        for block in _FENCE.findall(page.read_text()):
            if not block.startswith("```python"):
                continue
            for module, names in _IMPORT.findall(block):
                for name in names.replace("(", "").replace(")", "").split(","):
                    name = name.strip().split(" as ")[0]
                    if name:
                        found.append((_name(page), module, name))
    return found


@pytest.mark.parametrize("page, module, name", _imports())
def test_the_examples_import_names_that_exist(page, module, name):
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # an optional dependency (the hf extra)
        pytest.skip(f"{module} does not import here: {exc}")
    assert hasattr(mod, name), f"{page}: `from {module} import {name}`: no such name"


def test_the_readme_installs_what_ci_installs():
    readme = README.read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for pin in re.findall(r'"((?:torch|nemo-automodel)==[\d.]+)"', ci):
        assert pin in readme, f"README.md's test command does not install {pin} as .ci/run does"
    assert "pip install -e . && python -m cudagraphs" in readme


@pytest.mark.parametrize(
    "heading, anchor",
    [
        (
            "The contract: errors, fallbacks and CUDAGRAPHS_DISABLE",
            "the-contract-errors-fallbacks-and-cudagraphs_disable",
        ),
        (
            "Migrating from torch or Transformer Engine",
            "migrating-from-torch-or-transformer-engine",
        ),
        ("With `transformers.Trainer`: one line", "with-transformerstrainer-one-line"),
        (
            "What stays: why some layers cannot reach eager's footprint",
            "what-stays-why-some-layers-cannot-reach-eagers-footprint",
        ),
    ],
)
def test_anchors_are_githubs(heading, anchor):
    assert _slug(heading) == anchor
