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


# ---- expandable segments for graph pools -----------------------------------------------


@pytest.fixture
def allocator_settings(monkeypatch):
    """The allocator's run-time settings, recorded instead of applied."""
    said: list[str] = []
    monkeypatch.setattr(torch_private, "_SET_ALLOCATOR_SETTINGS", said.append)
    monkeypatch.setattr(torch_private, "_GET_ALLOCATOR_SETTINGS", lambda: "")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return said


def test_expandable_segments_turns_the_setting_on_inside_and_off_after(allocator_settings):
    with torch_private.expandable_segments():
        assert allocator_settings == ["expandable_segments:True"]
    assert allocator_settings == ["expandable_segments:True", "expandable_segments:False"]


def test_expandable_segments_turns_it_off_after_an_error_too(allocator_settings):
    with pytest.raises(RuntimeError, match="inside"), torch_private.expandable_segments():
        raise RuntimeError("inside")
    assert allocator_settings[-1] == "expandable_segments:False"


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_process_that_chose_expandable_segments_is_left_as_it_is(
    allocator_settings, monkeypatch, variable
):
    monkeypatch.setenv(variable, "max_split_size_mb:128, expandable_segments:True")
    with torch_private.expandable_segments():
        pass
    assert allocator_settings == []


def test_a_setting_made_at_run_time_is_left_as_it_is(allocator_settings, monkeypatch):
    monkeypatch.setattr(
        torch_private, "_GET_ALLOCATOR_SETTINGS", lambda: "expandable_segments:True"
    )
    with torch_private.expandable_segments():
        pass
    assert allocator_settings == []


def test_expandable_segments_is_a_no_op_on_a_torch_without_run_time_settings(monkeypatch):
    monkeypatch.setattr(torch_private, "_SET_ALLOCATOR_SETTINGS", None)
    assert not torch_private.can_make_expandable_segments()
    with torch_private.expandable_segments():
        pass


@pytest.mark.parametrize(("value", "expandable"), [(None, True), ("1", True), ("0", False)])
def test_graph_pools_are_expandable_unless_turned_off(
    allocator_settings, monkeypatch, value, expandable
):
    from cudagraphs.graph_pool import pool_segments
    from cudagraphs.settings import EXPANDABLE_POOLS_ENV

    if value is None:
        monkeypatch.delenv(EXPANDABLE_POOLS_ENV, raising=False)
    else:
        monkeypatch.setenv(EXPANDABLE_POOLS_ENV, value)
    with pool_segments():
        pass
    assert allocator_settings == (
        ["expandable_segments:True", "expandable_segments:False"] if expandable else []
    )


def test_a_malformed_expandable_pools_value_is_an_error_naming_it(monkeypatch):
    from cudagraphs.errors import CudaGraphsValueError
    from cudagraphs.graph_pool import pool_segments
    from cudagraphs.settings import EXPANDABLE_POOLS_ENV

    monkeypatch.setenv(EXPANDABLE_POOLS_ENV, "maybe")
    with pytest.raises(CudaGraphsValueError, match=EXPANDABLE_POOLS_ENV):
        pool_segments()


def test_tensor_guards_class_is_dynamos_class_whatever_else_is_optional():
    assert torch_private.tensor_guards_class().__name__ == "TensorGuards"


def test_mark_dynamic_marks_where_dynamo_has_the_mark_and_says_false_where_not(monkeypatch):
    import torch

    from cudagraphs import torch_private

    calls = []
    monkeypatch.setattr(
        torch_private,
        "MARK_DYNAMIC",
        torch_private.PrivateName("torch", "_cudagraphs_no_such_mark", "a test"),
    )
    assert torch_private.mark_dynamic(torch.zeros(2, 3), 0) is False
    monkeypatch.setattr(
        torch, "_cudagraphs_test_mark", lambda t, d: calls.append((t, d)), raising=False
    )
    monkeypatch.setattr(
        torch_private,
        "MARK_DYNAMIC",
        torch_private.PrivateName("torch", "_cudagraphs_test_mark", "a test"),
    )
    t = torch.zeros(2, 3)
    assert torch_private.mark_dynamic(t, 1) is True
    assert calls == [(t, 1)]


def test_size_oblivious_shapes_turns_the_setting_on_only_inside_and_says_where_absent(
    monkeypatch,
):
    import torch.fx.experimental._config as config

    from cudagraphs import torch_private

    assert config.backed_size_oblivious is False
    with torch_private.size_oblivious_shapes() as on:
        assert on is True and config.backed_size_oblivious is True
    assert config.backed_size_oblivious is False
    for owner, name in (
        ("torch._cudagraphs_no_such_module", "x"),
        ("torch.fx.experimental._config", "no_such_flag"),
    ):
        monkeypatch.setattr(
            torch_private, "SIZE_OBLIVIOUS", torch_private.PrivateName(owner, name, "a test")
        )
        with torch_private.size_oblivious_shapes() as on:
            assert on is False and config.backed_size_oblivious is False


def test_a_storage_count_is_its_tensors_plus_the_storage_objects_own_uses():
    from cudagraphs.torch_private import storage_object_uses, storage_use_count

    own = storage_object_uses()
    t = torch.zeros(4)
    assert storage_use_count(t.untyped_storage()) == 1 + own
    views = [t[:2], t.view(2, 2)]
    assert storage_use_count(t.untyped_storage()) == 1 + len(views) + own
    del views
    assert storage_use_count(t.untyped_storage()) == 1 + own
