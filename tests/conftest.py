import os
import sys

import pytest
import torch

# Tests run against the source tree (python -m pytest from the repo root) whether or
# not the package is installed.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
# Tests are grouped by layer (tests/core, tests/program, tests/partial, tests/serving,
# tests/benchmarks, ...); the shared helpers live in tests/helpers (helpers.hf_models, ...).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches reset before and after the test, so that no compile of one test
    serves (or fills the recompile limit of) another; yields ``torch._dynamo``."""
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def pytest_make_parametrize_id(config, val, argname):
    # A regex match pattern used as a parameter (r"args\[0\]") would put backslashes in
    # the test id, and pytest cannot select such a test by its id again: the mutation
    # runs (mutmut) select tests by id. Drop the backslashes; the id stays readable.
    if isinstance(val, str) and "\\" in val:
        return val.replace("\\", "")
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """A run that selected only GPU tests (``pytest -m cuda``, or GPU files alone) on a
    machine where CUDA is not usable would report every test skipped and exit 0: a GPU
    run that passes by skipping. Fail it instead, saying why. A run that also selected
    CPU tests (plain ``pytest``) keeps skipping the GPU ones."""
    items = session.items
    if not items or torch.cuda.is_available():
        return
    if all("cuda" in item.keywords for item in items):
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
        pytest.exit(
            f"{len(items)} GPU test(s) were selected, but CUDA is not usable here (torch "
            f"{torch.__version__}, {build}; torch.cuda.is_available() is False): they would "
            "all be skipped. Run them on a GPU machine (a CUDA build of torch and a working "
            "driver), or run the whole suite (plain pytest), which skips them.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
