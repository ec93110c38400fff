"""``GradStaging`` against its rule written out (hypothesis): which dtypes get a buffer
and how large, and which gradients a backward's ``stage`` copies into it, where.

The rule: per (dtype, device), an entry needs the sum of its contiguous parameters that
require grad; the buffer is the largest entry's need, made only where the entries'
needs add up to more than twice it. ``stage`` walks the gradients in order and copies
each contiguous one into the next free part of its dtype's buffer, where it fits;
every other gradient is handed back as it is.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraphs.core.grad_staging import GradStaging

DTYPES = (torch.float32, torch.bfloat16)

PARAM = st.tuples(
    st.sampled_from(DTYPES),
    st.integers(0, 6),  # numel
    st.booleans(),  # requires_grad
    st.booleans(),  # contiguous
)


def _param(dtype, n, requires_grad, contiguous):
    # A strided view is not contiguous (a size under 2 always is).
    flat = contiguous or n < 2
    t = torch.zeros(n, dtype=dtype) if flat else torch.zeros(n, 2, dtype=dtype)[:, 0]
    return t.requires_grad_(requires_grad)


def _reference_sizes(groups):
    sizes, totals = {}, {}
    for params in groups:
        need = {}
        for p in params:
            if p.requires_grad and p.is_contiguous():
                need[p.dtype] = need.get(p.dtype, 0) + p.numel()
        for d, n in need.items():
            sizes[d] = max(sizes.get(d, 0), n)
            totals[d] = totals.get(d, 0) + n
    return {d: n for d, n in sizes.items() if totals[d] > 2 * n}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(PARAM, max_size=5), min_size=1, max_size=5))
def test_buffers_are_sized_by_the_rule(groups):
    made = [[_param(*spec) for spec in params] for params in groups]
    staging = GradStaging.for_params(made)
    want = _reference_sizes(made)
    if not want:
        assert staging is None
        return
    got = {dtype: b.numel() for (dtype, _), b in staging.buffers.items()}
    assert got == want
    assert all(b.device == torch.device("cpu") for b in staging.buffers.values())
    assert staging.nbytes() == sum(
        n * torch.empty(0, dtype=d).element_size() for d, n in want.items()
    )


GRAD = st.one_of(
    st.none(),
    st.tuples(st.sampled_from(DTYPES), st.integers(0, 5), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.dictionaries(st.sampled_from(DTYPES), st.integers(0, 8), max_size=2),
    specs=st.lists(GRAD, max_size=8),
)
def test_stage_copies_what_fits_in_order_and_hands_back_the_rest(sizes, specs):
    staging = GradStaging(
        {(d, torch.device("cpu")): torch.full((n,), -1.0, dtype=d) for d, n in sizes.items()}
    )
    grads = []
    for k, spec in enumerate(specs):
        if spec is None:
            grads.append(None)
            continue
        dtype, n, contiguous = spec
        g = _param(dtype, n, False, contiguous)
        with torch.no_grad():
            g.copy_(torch.arange(n, dtype=torch.float32) + 10 * k)
        grads.append(g)
    out = staging.stage(grads)
    offsets = dict.fromkeys(sizes, 0)
    for g, o in zip(grads, out):
        buffer = staging.buffers.get((g.dtype, g.device)) if g is not None else None
        fits = (
            g is not None
            and g.is_contiguous()
            and buffer is not None
            and offsets[g.dtype] + g.numel() <= buffer.numel()
        )
        if not fits:
            assert o is g, "handed back as it is"
            continue
        start = offsets[g.dtype]
        offsets[g.dtype] += g.numel()
        assert o.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert o.storage_offset() == start and o.shape == g.shape
        assert torch.equal(o, g), "the gradient's values, copied"
