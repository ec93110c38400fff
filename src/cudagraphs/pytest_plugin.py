"""A pytest plugin that runs any test file against cudagraphs' ``make_graphed_callables``:
torch's ``torch.cuda.make_graphed_callables`` (and Transformer Engine's, where it is
installed) are replaced by ours for the whole run, before any test module is imported,
and put back at its end. Load it by name::

    python -m pytest -p cudagraphs.pytest_plugin path/to/upstream/test_cuda.py -k make_graphed_callables

It is not registered as an entry point: it changes what the tests call, so it runs
only when asked for. The header of the run says what was swapped; the tests get the
:class:`~cudagraphs.integrations.upstream.HelperSwap` as the ``cudagraphs_swap``
fixture. See :mod:`cudagraphs.integrations.upstream` for what the swap does.
"""

from __future__ import annotations

from typing import Any

import pytest

from .integrations.upstream import HelperSwap, swap_make_graphed_callables

_SWAP = pytest.StashKey[HelperSwap]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SWAP] = swap_make_graphed_callables()


def pytest_unconfigure(config: pytest.Config) -> None:
    swap = config.stash.get(_SWAP, None)
    if swap is not None:
        swap.restore()


def pytest_report_header(config: pytest.Config) -> list[str]:
    swap = config.stash.get(_SWAP, None)
    if swap is None:
        return []
    return [
        "cudagraphs: make_graphed_callables swapped in at " + ", ".join(swap.sites),
        f"cudagraphs: Transformer Engine {swap.te_status}",
    ]


@pytest.fixture
def cudagraphs_swap(request: pytest.FixtureRequest) -> Any:
    """The run's :class:`~cudagraphs.integrations.upstream.HelperSwap`."""
    return request.config.stash[_SWAP]
