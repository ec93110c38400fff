"""Every private torch API cudagraphs uses, in one place.

torch keeps these out of its public surface and may move them in any release. Spread
over the package, a moved one failed far from here, or silently: a missing
``_current_graph_task_id`` would have turned off activation-checkpoint detection, a
missing ``_cuda_endAllocateToPool`` the allocator repair after a failed capture. Here
each is looked up once, at import, and a missing one raises
:class:`UnsupportedTorchError` naming the torch version, the name and what needs it.
``tests/test_torch_private_cpu.py`` asks the same of the installed torch on the CPU.

The names fall in three groups:

- :data:`REQUIRED`: present in every torch build cudagraphs supports;
- :data:`REQUIRED_WITH_CUDA`: present in builds with CUDA (or ROCm) support; a
  CPU-only build lacks them and has no graphs to capture, so they are checked only
  where ``torch.backends.cuda.is_built()``;
- :data:`OPTIONAL`: speed-ups with a correct fallback, said where used
  (:func:`tensor_guards_class`).

``torch.utils._pytree`` (our tree handling, by the project's rule) and torch's
underscore ops (``torch._foreach_copy_``, ``torch._grouped_mm``) are not listed: the
first is the one tree library torch itself maintains for this, the second are
operators, versioned with torch's op schema.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UnsupportedTorchError

__all__ = [
    "OPTIONAL",
    "REQUIRED",
    "COMPILATION_METRICS",
    "MARK_DYNAMIC",
    "SIZE_OBLIVIOUS",
    "REQUIRED_WITH_CUDA",
    "TENSOR_GUARDS",
    "PrivateName",
    "UnsupportedTorchError",
    "STORAGE_USE_COUNT",
    "SWAP_STORAGE_DATA",
    "SubgraphSchemaMemo",
    "below_autograd",
    "can_make_expandable_segments",
    "can_count_storage_uses",
    "can_move_storages",
    "check_torch",
    "clear_cublas_workspaces",
    "compiled_module",
    "current_graph_task_id",
    "compilation_metrics",
    "cudagraph_tree_functions",
    "current_stream_key",
    "custom_graph_pass_class",
    "device_index",
    "dynamo_loaded",
    "begin_allocate_to_pool",
    "end_allocate_to_pool",
    "expandable_segments",
    "files_hash",
    "mark_dynamic",
    "memoized_subgraph_schemas",
    "compile_modes",
    "inductor_records_graphs",
    "recompile_limit_at_least",
    "mode_options",
    "upstream_caches_subgraph_schemas",
    "release_pool",
    "set_grad_enabled",
    "size_oblivious_shapes",
    "start_compile_workers",
    "storage_key",
    "storage_object_uses",
    "storage_use_count",
    "swap_storage_data",
    "view_base",
    "tensor_guards_class",
    "will_engine_execute_node",
]


@dataclass(frozen=True)
class PrivateName:
    """One private torch attribute: where it lives and what needs it."""

    owner: str  # dotted module path: "torch._C", "torch.cuda"
    name: str
    used_for: str

    def lookup(self) -> Any:
        """The attribute, or ``None`` when the installed torch lacks it."""
        module: Any = torch
        for part in self.owner.split(".")[1:]:
            module = getattr(module, part, None)
            if module is None:
                return None
        return getattr(module, self.name, None)


REQUIRED: tuple[PrivateName, ...] = (
    PrivateName(
        "torch._C",
        "_current_graph_task_id",
        "telling an activation-checkpoint recompute (run inside backward) from a second "
        "call of a partial-graph target",
    ),
    PrivateName(
        "torch._C",
        "_will_engine_execute_node",
        "telling backward() (gradients added into .grad) from autograd.grad() when a "
        "graph hands parameter gradients to autograd",
    ),
    PrivateName(
        "torch._C",
        "_AutoDispatchBelowADInplaceOrView",
        "the program layer's fused input copy below autograd",
    ),
    PrivateName("torch._C", "_set_grad_enabled", "switching grad mode without a context object"),
    PrivateName("torch.cuda", "_get_device_index", "keying the capture stream per device"),
)

REQUIRED_WITH_CUDA: tuple[PrivateName, ...] = (
    PrivateName(
        "torch._C",
        "_cuda_endAllocateToPool",
        "ending the allocator's routing into a graph pool after a failed capture",
    ),
    PrivateName(
        "torch._C",
        "_cuda_beginAllocateToPool",
        "warming up inside a fresh graph pool, so that the capture reuses the warmup's "
        "memory (GraphMemoryPool.warmup_scope)",
    ),
    PrivateName(
        "torch._C",
        "_cuda_releasePool",
        "dropping the use of a graph pool that a warmup inside it took",
    ),
    PrivateName(
        "torch._C",
        "_cuda_getCurrentStream",
        "the program layer's per-replay check of the current stream, without building "
        "a Stream object",
    ),
    PrivateName(
        "torch._C",
        "_cuda_clearCublasWorkspaces",
        "making a capture stream's cuBLAS workspace inside its graph pool, even when "
        "torch hands out a stream that eager matmuls used before (GraphMemoryPool."
        "capture_stream)",
    ),
)

TENSOR_GUARDS = PrivateName(
    "torch._C._dynamo.guards",
    "TensorGuards",
    "the program layer's C++ check of tensor metadata on replay (without it, the "
    "full Python check runs on every replay)",
)

COMPILATION_METRICS = PrivateName(
    "torch._dynamo.utils",
    "get_compilation_metrics",
    "what torch.compile compiled during a warmup or capture "
    "(cudagraphs.compile_watch); without it nothing is checked",
)

MARK_DYNAMIC = PrivateName(
    "torch._dynamo",
    "mark_dynamic",
    "compiling a serving model's decode step once for every bucket of two rows or more "
    "(the batch dimension dynamic from the first compile); without it torch's "
    "automatic dynamic shapes compile once more",
)

SIZE_OBLIVIOUS = PrivateName(
    "torch.fx.experimental._config",
    "backed_size_oblivious",
    "one compile of a serving model's decode step for a bucket of one row too (no 0/1 "
    "specialization of the batch dimension); without it that bucket compiles apart",
)

STORAGE_USE_COUNT = PrivateName(
    "torch._C",
    "_storage_Use_Count",
    "telling whether anything beside a graph still refers to an owned gradient it "
    "lent (cudagraphs.core.deferred_grads); without it owned gradients are copied at "
    "every backward replay",
)

SWAP_STORAGE_DATA = PrivateName(
    "torch.UntypedStorage",
    "_swap_data_ptr_",
    "moving a lent owned gradient that something still holds to memory of its own, "
    "views of it included (cudagraphs.core.deferred_grads); without it the tensors "
    "handed out are moved one by one, and a kept view of one raises",
)

OPTIONAL: tuple[PrivateName, ...] = (
    COMPILATION_METRICS,
    STORAGE_USE_COUNT,
    SWAP_STORAGE_DATA,
    MARK_DYNAMIC,
    SIZE_OBLIVIOUS,
    PrivateName(
        "torch._C",
        "_accelerator_setAllocatorSettings",
        "graph pools grown as expandable segments (expandable_segments); without it "
        "pools are made as the allocator's settings say",
    ),
    PrivateName(
        "torch._C",
        "_accelerator_getAllocatorSettings",
        "leaving a process's own expandable_segments:True as it is",
    ),
    TENSOR_GUARDS,
)


def check_torch(cuda_built: bool | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` listing every required name the installed
    torch lacks (the CUDA ones only in a CUDA build: ``cuda_built``, by default
    ``torch.backends.cuda.is_built()``)."""
    if cuda_built is None:
        cuda_built = torch.backends.cuda.is_built()
    names = REQUIRED + (REQUIRED_WITH_CUDA if cuda_built else ())
    missing = [n for n in names if n.lookup() is None]
    if missing:
        listed = "; ".join(f"{n.owner}.{n.name} (for {n.used_for})" for n in missing)
        raise UnsupportedTorchError(
            f"torch {torch.__version__} lacks private API that cudagraphs uses: {listed}. "
            "Fix: install a torch release cudagraphs supports (pyproject.toml and the "
            "README name the tested ones), or report this torch version."
        )


check_torch()

# ---- the names, as cudagraphs calls them ----------------------------------------------

set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled
_SET_ALLOCATOR_SETTINGS: Callable[[str], None] | None = getattr(
    torch._C, "_accelerator_setAllocatorSettings", None
)
_GET_ALLOCATOR_SETTINGS: Callable[[], str] | None = getattr(
    torch._C, "_accelerator_getAllocatorSettings", None
)
current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
will_engine_execute_node: Callable[[Any], bool] = torch._C._will_engine_execute_node
#: A context manager class: ops inside dispatch below autograd (no history, no
#: version-counter bumps).
below_autograd: type = torch._C._AutoDispatchBelowADInplaceOrView
device_index: Callable[..., int] = torch.cuda._get_device_index


def end_allocate_to_pool(device: int, pool: Any) -> None:
    """End the caching allocator's routing of ``device``'s allocations into ``pool``
    (raises when nothing is routed there)."""
    torch._C._cuda_endAllocateToPool(device, pool)


def begin_allocate_to_pool(device: int, pool: Any) -> None:
    """Route every allocation on ``device`` (any thread, any stream) into the private
    pool ``pool``, taking a use of it; undo with :func:`end_allocate_to_pool` and
    :func:`release_pool`.

    Every thread, not only the caller's (``_cuda_beginAllocateCurrentThreadToPool``,
    which torch.compile's CUDA-graph trees use around code they run themselves):
    autograd runs a CUDA backward on its own device thread, and a warmup's backward
    allocates its gradients and temporaries there."""
    torch._C._cuda_beginAllocateToPool(device, pool)


def can_make_expandable_segments() -> bool:
    """Whether this torch lets the allocator's settings change at run time."""
    return _SET_ALLOCATOR_SETTINGS is not None


@contextmanager
def expandable_segments() -> Iterator[None]:
    """The caching allocator makes expandable segments inside this scope (its
    ``expandable_segments`` setting on), and what it made before after it; a no-op on
    a torch without run-time allocator settings, or where the process set
    ``expandable_segments:True`` itself.

    A segment made inside stays expandable: one virtual range per pool and stream
    that grows page by page, so blocks freed next to each other merge whatever size
    they were allocated with (pytorch#128068 brought private pools the feature)."""
    if _SET_ALLOCATOR_SETTINGS is None or _expandable_now():
        yield
        return
    _SET_ALLOCATOR_SETTINGS("expandable_segments:True")
    try:
        yield
    finally:
        _SET_ALLOCATOR_SETTINGS("expandable_segments:False")


def _expandable_now() -> bool:
    settings = [os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")]
    if _GET_ALLOCATOR_SETTINGS is not None:
        settings.append(str(_GET_ALLOCATOR_SETTINGS() or ""))
    return "expandable_segments:true" in ",".join(settings).replace(" ", "").lower()


def clear_cublas_workspaces() -> None:
    """Drop torch's references to every cuBLAS workspace it keeps per (handle, stream):
    the next matmul on any stream makes a new one, and memory a captured graph holds
    stays its graph's (what torch.compile's CUDA-graph trees do each time they record)."""
    torch._C._cuda_clearCublasWorkspaces()


def release_pool(device: int, pool: Any) -> None:
    """Give back the use of ``pool`` that :func:`begin_allocate_to_pool` took."""
    torch._C._cuda_releasePool(device, pool)


def can_count_storage_uses() -> bool:
    """Whether this torch has what :func:`storage_use_count` needs."""
    return STORAGE_USE_COUNT.lookup() is not None


def can_move_storages() -> bool:
    """Whether this torch has what :func:`swap_storage_data` needs."""
    return SWAP_STORAGE_DATA.lookup() is not None


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references the C++ storage behind ``storage`` has: one per tensor on
    it, one per Python storage object (``storage`` itself included)."""
    return torch._C._storage_Use_Count(storage._cdata)


def storage_key(t: torch.Tensor) -> int:
    """One key per storage, equal for every tensor viewing it (fake tensors of one
    trace included): the storage's C++ address, which its Python wrapper does not
    keep (``untyped_storage()`` makes a new wrapper at every call)."""
    return t.untyped_storage()._cdata


def storage_object_uses() -> int:
    """The references one Python storage object adds to its C++ storage's use count
    (:func:`storage_use_count`), measured on a fresh tensor: what a count taken
    through ``tensor.untyped_storage()`` includes beside the tensors on it."""
    probe = torch.empty(1)  # kept alive: its one reference is the count's baseline
    return storage_use_count(probe.untyped_storage()) - 1


def swap_storage_data(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages of one device: every tensor on ``a`` (views
    included) now reads ``b``'s bytes at ``b``'s address, and the other way round;
    each memory is freed with the storage that holds it now."""
    a._swap_data_ptr_(b)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (its autograd view record), or ``None``."""
    return t._base


def current_stream_key() -> Callable[[int], Any]:
    """The function that returns ``(stream id, device, device type)`` of the current
    stream of a device index: cheaper per call than ``torch.cuda.current_stream``."""
    return torch._C._cuda_getCurrentStream


def dynamo_loaded() -> bool:
    """Whether ``torch._dynamo`` has been imported (then something may be compiled);
    asked without importing it, which costs seconds."""
    return "torch._dynamo" in sys.modules


def compiled_module(module: torch.nn.Module) -> str | None:
    """How ``module`` is compiled: ``"torch.compile(module)"`` for the wrapper
    ``torch.compile`` returns (dynamo's ``OptimizedModule``), ``"module.compile()"``
    for a module whose calls go through a compiled ``_call_impl``; ``None`` when it
    is not compiled itself (its submodules may be)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "module.compile()"
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return "torch.compile(module)"
    return None


def mark_dynamic(tensor: torch.Tensor, dim: int) -> bool:
    """Tell ``torch.compile`` that ``tensor``'s dimension ``dim`` varies between calls,
    so that its first compile is already shape-generic there; ``False`` where this
    torch has no such mark (automatic dynamic shapes then recompile once). Imports
    dynamo: call it only where something is compiled."""
    mark = MARK_DYNAMIC.lookup()
    if mark is None:
        return False
    mark(tensor, dim)
    return True


@contextmanager
def size_oblivious_shapes() -> Iterator[bool]:
    """While open, dynamo reasons about dynamic sizes without specializing 0 and 1
    (torch's ``backed_size_oblivious``), so that a compile made at one size serves a
    size of 1 too; yields whether this torch has the setting (without it, nothing
    changes). Imports torch.fx's experimental config: call it only where something is
    compiled."""
    import importlib

    try:
        config = importlib.import_module(SIZE_OBLIVIOUS.owner)
    except ImportError:
        config = None
    if config is None or not hasattr(config, SIZE_OBLIVIOUS.name):
        yield False
        return
    with config.patch(**{SIZE_OBLIVIOUS.name: True}):
        yield True


@dataclass
class SubgraphSchemaMemo:
    """What :func:`memoized_subgraph_schemas` did while open.

    Attributes:
        active: whether the memo was installed (``False`` where this torch caches the
            schemas itself, lacks the hook, or an outer memo is open).
        built: schemas made (one subgraph traced each).
        reused: calls answered from the memo (a trace of the subgraph each, saved).
    """

    active: bool = False
    built: int = 0
    reused: int = 0


def upstream_caches_subgraph_schemas() -> bool:
    """Whether this torch keeps ``invoke_subgraph``'s functionalization schema per
    compile itself (pytorch/pytorch#184646): then :func:`memoized_subgraph_schemas`
    installs nothing."""
    import importlib

    guards = importlib.import_module("torch._guards")
    cache = getattr(guards, "InvokeSubgraphCache", None)
    return hasattr(cache, "get_functionalize_schema_entry")


@contextmanager
def memoized_subgraph_schemas(force: bool = False) -> Iterator[SubgraphSchemaMemo]:
    """While open, ``invoke_subgraph``'s schema (``InvokeSubgraphHOP.gen_schema``) is
    made once per subgraph and kept for every later call of it.

    Why: a nested compile region called N times (a decoder layer per layer) is
    functionalized N times in AOTAutograd's metadata pass and again in its trace, and
    torch 2.11 makes the region's schema at each call by tracing the whole subgraph
    again (``materialize_as_graph``). For a 16-layer Llama decode step that was 32
    traces and about a third of its 21 s cold compile on an H100. pytorch/pytorch#184646
    keeps that schema per compile, keyed by the subgraph, its identifier and the
    operands' types; a torch with that cache
    (:func:`upstream_caches_subgraph_schemas`) is left alone. The memo uses the same key: a
    schema says which operands the subgraph mutates and the types of its operands and
    outputs, all fixed by the subgraph and the operand types. It holds each subgraph
    it keyed, so that no id is reused while it is open, and it is dropped on close.

    ``force`` installs it on a torch with the cache too (tests). Yields the
    :class:`SubgraphSchemaMemo`; where the hook is missing nothing changes.
    """
    import importlib

    memo = SubgraphSchemaMemo()
    try:
        module = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
        hop_class = module.InvokeSubgraphHOP
        original = hop_class.__dict__["gen_schema"]
    except (ImportError, AttributeError, KeyError):
        yield memo
        return
    if getattr(original, "memoized_by_cudagraphs", False) or (
        upstream_caches_subgraph_schemas() and not force
    ):
        yield memo
        return
    schemas: dict[tuple[Any, ...], tuple[Any, Any]] = {}

    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        if not isinstance(identifier, str):
            return original(self, subgraph, identifier, *operands)
        key = (id(subgraph), identifier, tuple(type(o) for o in operands))
        hit = schemas.get(key)
        if hit is not None:
            memo.reused += 1
            return hit[1]
        schema = original(self, subgraph, identifier, *operands)
        schemas[key] = (subgraph, schema)
        memo.built += 1
        return schema

    gen_schema.memoized_by_cudagraphs = True  # type: ignore[attr-defined]
    hop_class.gen_schema = gen_schema
    memo.active = True
    try:
        yield memo
    finally:
        hop_class.gen_schema = original
        schemas.clear()


def start_compile_workers() -> bool:
    """Start inductor's pool of Triton compile workers now; whether this torch could.

    Why: inductor starts that pool when its backend is first called, after dynamo's
    trace, and compiles a kernel in the calling process while the pool is not ready
    yet. In a fresh process the compiled generator's capture compiled its Triton
    kernels that way for 2.7 to 3.7 s (``async_compile.precompile``) on an H100.
    Started before the first compiled call, the pool has dynamo's trace and
    AOTAutograd's to come up (about 6 s for the benchmark's 16-layer Llama decode step
    there), and those in-process builds went away: the cold capture took 13.9 s
    against 15.7 s without the early start (``benchmarks/probes/compile_phases.py``).
    Where torch has no such start (or its ``TORCH_WARM_POOL=0`` turns it off), nothing
    happens."""
    import importlib

    try:
        module = importlib.import_module("torch._inductor.async_compile")
    except ImportError:
        return False
    warm = getattr(module, "maybe_warm_pool", None)
    if warm is None:
        return False
    warm()
    return True


def compilation_metrics() -> list[Any]:
    """dynamo's compilation records (``CompilationMetrics``, one per compiled frame,
    oldest first), or ``[]`` where this torch keeps none. Imports dynamo: ask
    :func:`dynamo_loaded` first."""
    get = COMPILATION_METRICS.lookup()
    return list(get()) if get is not None else []


def cudagraph_tree_functions(device_index: int) -> int:
    """How many functions torch.compile's CUDA-graph trees (``mode="reduce-overhead"``)
    have warmed up or recorded on ``device_index`` in this thread; 0 where they were
    never loaded. A count that grows over a phase means the phase ran them."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return 0
    try:
        manager = trees.get_container(device_index).tree_manager
        if manager is None:
            return 0
        recorded = sum(len(nodes) for nodes in manager.roots.values())
        return recorded + len(manager.warmed_up_functions)
    except Exception:  # a private API: a change in it loses the check, nothing else
        return 0


def tensor_guards_class() -> type | None:
    """torch's ``TensorGuards`` (dynamo's C++ tensor-metadata check), or ``None``
    where this torch has none: callers then check in Python."""
    return TENSOR_GUARDS.lookup()


def custom_graph_pass_class() -> type:
    """inductor's ``CustomGraphPass``, the base of a pass set as
    ``post_grad_custom_pre_pass`` that inductor's FX graph cache can key (imports
    dynamo and inductor: call it when compiling)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def files_hash(*paths: str) -> bytes:
    """inductor's hash of source files, the ``uuid`` a custom pass gives its cache."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(tuple(paths))


def inductor_records_graphs() -> bool:
    """Whether inductor's global config turns on its CUDA-graph trees for every compile
    (``triton.cudagraphs``; ``TORCHINDUCTOR_CUDAGRAPHS=1`` sets it at import)."""
    import torch._inductor.config

    return bool(torch._inductor.config.triton.cudagraphs)


@contextmanager
def recompile_limit_at_least(limit: int) -> Iterator[None]:
    """dynamo's ``recompile_limit`` (compiles kept per code object, 8 by default) at
    least ``limit`` inside the block: dynamo reads it when a frame compiles."""
    import torch._dynamo

    config = torch._dynamo.config
    with config.patch(recompile_limit=max(config.recompile_limit, limit)):
        yield


def compile_modes() -> tuple[str, ...]:
    """The modes ``torch.compile`` takes (inductor's list: it raises on others only at
    the first compile)."""
    from torch._inductor import list_mode_options

    return tuple(list_mode_options())


def parameter_table(module: torch.nn.Module) -> dict[str, Any]:
    """The module's own name -> parameter mapping, the dict ``register_parameter`` and
    attribute assignment write (and FSDP2's unshard too): one lookup in it is about a
    tenth of ``getattr``, which goes through ``Module.__getattr__``."""
    return getattr(module, "_parameters")  # noqa: B009  read by name: private to torch


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter: autograd's count of in-place writes to its memory
    (views share it), which is how a write into an argument is seen."""
    return getattr(t, "_version", 0)  # read by name: private to torch


def compile_backends() -> tuple[str, ...]:
    """The backend names ``torch.compile`` takes, every tag included (dynamo's
    registry: an unknown name raises ``InvalidBackend`` at ``torch.compile``)."""
    from torch._dynamo import list_backends

    return tuple(list_backends(exclude_tags=()))


def mode_options(mode: str, dynamic: bool | None = None) -> dict[str, Any]:
    """The inductor options ``torch.compile(mode=mode)`` stands for: torch takes a mode
    or options, never both, so a pass added to the options carries the mode's too."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))
