"""Helpers of the GPU tests of CudaGraphProgram and CudaGraphPool
(tests/program/test_cuda_program_*.py): inputs drawn on the CPU, trees of tensors and
quantized leaves, and snapshots of a program's buffer and borrowed output."""

import torch

from cudagraphs import CudaGraphPool, CudaGraphProgram
from helpers.asserts import assert_bitwise_equal
from helpers.leaf_types import QuantizedTensor

MiB = 1 << 20
# torch.cuda._sleep spins this many GPU clock cycles: tens of milliseconds on an H200,
# far longer than the host needs to issue the racing work in the ordering tests.
SLEEP_CYCLES = 50_000_000


def _randn(*shape, seed=0, dtype=torch.float32, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _pinned(*shape, seed):
    out = torch.empty(*shape, pin_memory=True)
    out.copy_(_randn(*shape, seed=seed, device="cpu"))
    assert out.is_pinned()
    return out


def _capture(function, *example_inputs, **kwargs):
    return CudaGraphProgram.capture(function, example_inputs=example_inputs, **kwargs)


def _pool(use_pool):
    return CudaGraphPool() if use_pool else None


def _close(pool):
    if pool is not None:
        pool.close()


def _quantized(*shape, seed, block=4, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    scale = torch.rand(1, generator=g) * 0.1 + 0.01
    return QuantizedTensor(data.to(device), scale.to(device), block)


def _map_tensors(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, QuantizedTensor):
        zp = None if tree.zero_point is None else fn(tree.zero_point)
        return QuantizedTensor(fn(tree.data), fn(tree.scale), tree.block, zp)
    if tree is None:
        return None
    if type(tree) is dict:
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    items = [_map_tensors(v, fn) for v in tree]
    return items if type(tree) is list else tuple(items)


def _tensors(tree):
    out = []
    _map_tensors(tree, out.append)
    return out


def _clone(tree):
    return _map_tensors(tree, lambda t: t.detach().clone())


def _assert_tree_equal(actual, expected, what):
    """Same structure, leaf types and metadata; every tensor bitwise equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__}, not a tensor"
        assert_bitwise_equal(actual, expected, what)
    elif isinstance(expected, QuantizedTensor):
        assert type(actual) is QuantizedTensor, f"{what}: {type(actual).__name__}"
        assert actual.block == expected.block, f"{what}: block {actual.block} != {expected.block}"
        assert_bitwise_equal(actual.data, expected.data, f"{what}.data")
        assert_bitwise_equal(actual.scale, expected.scale, f"{what}.scale")
    elif expected is None:
        assert actual is None, f"{what}: {type(actual).__name__} instead of None"
    elif type(expected) is dict:
        assert type(actual) is dict, f"{what}: {type(actual).__name__} instead of dict"
        assert set(actual) == set(expected), f"{what}: keys {set(actual)} != {set(expected)}"
        for k in expected:
            _assert_tree_equal(actual[k], expected[k], f"{what}[{k!r}]")
    else:
        assert type(actual) is type(expected), f"{what}: {type(actual).__name__}"
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_tree_equal(a, e, f"{what}[{i}]")


def _snapshot(program):
    """Clones of the fixed input buffer and of the borrowed output (synchronized)."""
    torch.cuda.synchronize()
    return [t.detach().clone() for t in program._buffer.tensors], _clone(program.output)


def _assert_unchanged(program, snapshot, what):
    torch.cuda.synchronize()
    buffers, output = snapshot
    for i, (now, before) in enumerate(zip(program._buffer.tensors, buffers)):
        assert_bitwise_equal(now.detach(), before, f"{what}: input buffer tensor {i}")
    _assert_tree_equal(program.output, output, f"{what}: borrowed output")


def _scale_shift(x):
    return x * 3 - 1


def _double(t):
    return t * 2
