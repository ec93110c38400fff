"""Property tests of the compiled-target policies against plain references: which code
object each target's compiled function runs (one per target class), and which modules
``refuse_compiled_parts`` names (every compiled one, in part and module order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cudagraphs.errors import CudaGraphsValueError
from cudagraphs.partial.build import refuse_compiled_parts
from cudagraphs.partial.graphing import TargetCompile, graphed_function

# Five target classes, made once: the property is about class identity.
CLASSES = [type(f"Target{i}", (nn.Linear,), {}) for i in range(5)]


def _rec(module):
    names = tuple(n for n, _ in module.named_parameters())
    return SimpleNamespace(target=SimpleNamespace(module=module), param_names=names, name="t")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(CLASSES) - 1), min_size=1, max_size=12))
def test_targets_of_one_class_share_a_code_object_and_no_two_classes_do(picks):
    compiler = TargetCompile({"backend": "eager"})
    codes = []
    for i in picks:
        fn = graphed_function(_rec(CLASSES[i](2, 2)), compiler)
        codes.append(fn.compiled._torchdynamo_orig_callable.__code__)
    first: dict[int, object] = {}
    for i, code in zip(picks, codes):
        assert code is first.setdefault(i, code)  # the class's first code, every time
    assert len({id(c) for c in first.values()}) == len(set(picks))
    assert set(compiler.codes) == {CLASSES[i] for i in picks}
    assert all(c.co_name == f"partial_{CLASSES[i].__name__}" for i, c in first.items())


# A part: a Sequential of up to four children, each a Linear or a Sequential of two;
# the flags say which of its modules are compiled with module.compile().
PART = st.lists(st.booleans(), min_size=1, max_size=4)


def _part(shape, flags):
    kids = [
        nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)) if two else nn.Linear(1, 1) for two in shape
    ]
    part = nn.Sequential(*kids)
    modules = list(part.named_modules())
    compiled = []
    for (name, module), flag in zip(modules, flags):
        if flag:
            module.compile(backend="eager")
            compiled.append(name)
    return part, compiled


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(PART, st.lists(st.booleans(), max_size=12)), min_size=1, max_size=3))
def test_every_compiled_module_is_named_in_part_and_module_order(parts):
    built, want = [], []
    for i, (shape, flags) in enumerate(parts):
        part, compiled = _part(shape, flags)
        built.append(part)
        want += [f"model part {i}{' ' + repr(n) if n else ''} (module.compile())" for n in compiled]
    if not want:
        refuse_compiled_parts(built)
        return
    with pytest.raises(CudaGraphsValueError) as info:
        refuse_compiled_parts(built)
    assert f"compiled modules in the model parts: {'; '.join(want)}. " in str(info.value)


def test_a_part_wrapped_by_torch_compile_is_named_as_such():
    part = nn.Linear(1, 1)
    with pytest.raises(CudaGraphsValueError, match=r"model part 0 \(torch.compile\(module\)\)"):
        refuse_compiled_parts([torch.compile(part, backend="eager")])
