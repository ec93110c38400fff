"""The seam of private torch API (CPU): every name resolves on the installed torch, a
missing one raises at import naming the torch version, the name and its use, and no
module outside the seam reaches into torch's private namespaces."""

import re
from pathlib import Path

import pytest
import torch

import cudagraphs
from cudagraphs import torch_private
from cudagraphs.errors import CudaGraphsError
from cudagraphs.torch_private import (
    OPTIONAL,
    REQUIRED,
    PrivateName,
    UnsupportedTorchError,
    check_torch,
)

SRC = Path(cudagraphs.__file__).parent


@pytest.mark.parametrize("name", REQUIRED + OPTIONAL, ids=lambda n: f"{n.owner}.{n.name}")
def test_every_name_resolves_on_this_torch(name):
    assert name.lookup() is not None, f"torch {torch.__version__} moved {name.owner}.{name.name}"


def test_a_missing_name_raises_naming_torch_the_name_and_its_use(monkeypatch):
    gone = PrivateName("torch._C", "_no_such_thing_here", "a test of the seam")
    monkeypatch.setattr(torch_private, "REQUIRED", (*REQUIRED, gone))
    with pytest.raises(UnsupportedTorchError) as err:
        check_torch(cuda_built=False)
    text = str(err.value)
    assert torch.__version__ in text and "torch._C._no_such_thing_here" in text
    assert "a test of the seam" in text and "Fix:" in text
    assert isinstance(err.value, CudaGraphsError) and isinstance(err.value, ImportError)


def test_cuda_names_are_asked_of_cuda_builds_only(monkeypatch):
    gone = PrivateName("torch._C", "_cuda_no_such_thing", "a CUDA-only test")
    monkeypatch.setattr(torch_private, "REQUIRED_WITH_CUDA", (gone,))
    check_torch(cuda_built=False)  # a CPU build: not asked
    with pytest.raises(UnsupportedTorchError, match="_cuda_no_such_thing"):
        check_torch(cuda_built=True)


def test_a_missing_owner_module_is_a_missing_name():
    assert PrivateName("torch._C._no_module", "x", "").lookup() is None


def test_the_package_imports_the_seam():
    import sys

    assert "cudagraphs.torch_private" in sys.modules


# Private namespaces reached with a dot: torch._C.<...>, torch.cuda._<...>,
# torch._dynamo... (torch.utils._pytree and underscore ops are allowed: see the seam).
PRIVATE = re.compile(r"torch\._C\b|torch\.cuda\._[a-z]|torch\._dynamo|torch\._inductor")


def test_no_module_but_the_seam_reaches_into_torch_private_namespaces():
    offenders = [
        f"{path.relative_to(SRC)}:{i}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "torch_private.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line.split("#")[0])
    ]
    assert offenders == [], offenders


def test_dynamo_loaded_answers_without_importing_dynamo():
    import subprocess
    import sys

    code = (
        "import sys, torch; from cudagraphs.torch_private import dynamo_loaded; "
        "before = dynamo_loaded(); import torch._dynamo; "
        "print(before, 'torch._dynamo' in sys.modules, dynamo_loaded())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["True", "True"]
    assert out.stdout.split()[0] == "False"  # importing cudagraphs does not load dynamo
