"""CUDA tests run under ``torch.use_deterministic_algorithms(True)``: there remat's
equivalence promise holds bitwise on CUDA (SPEC section 5), as it does on CPU."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

# cuBLAS's deterministic mode needs this workspace setting, read when cuBLAS starts (at the
# first CUDA matrix product): before any test runs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _deterministic_on_cuda(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.fixture(autouse=True)
def _no_thread_outlives_its_test() -> Iterator[None]:
    """A thread left alive makes every later region on the worker capture random numbers
    per op (remat's threaded mode), so the tests of its single-threaded lending fail or
    pass by the order the worker ran them in (inductor's compile pool did, CI's torch 2.15
    leg). Patch ``compile_threads=1`` for inductor; join what a test starts."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and type(t).__name__ != "TMonitor"]
    for thread in left:
        thread.join(timeout=5)  # one that is ending as the test returns
    alive = [thread.name for thread in left if thread.is_alive()]
    assert not alive, f"threads outlive the test: {alive}"
