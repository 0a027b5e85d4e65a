"""CUDA tests run under ``torch.use_deterministic_algorithms(True)``: there remat's
equivalence promise holds bitwise on CUDA (SPEC section 5), as it does on CPU."""

from __future__ import annotations

import os
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
