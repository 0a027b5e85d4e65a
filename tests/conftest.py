"""Test-session settings."""

from __future__ import annotations

import contextlib


def pytest_configure(config: object) -> None:
    # torch.compile shows tqdm progress bars, and tqdm starts a monitor thread that lives
    # as long as the process: in every later test of that worker, remat would see another
    # thread alive and capture random numbers per op, and the tests of the path without
    # other threads would fail. The monitor only refreshes stalled bars; switch it off.
    with contextlib.suppress(ImportError):
        from tqdm import tqdm

        tqdm.monitor_interval = 0
