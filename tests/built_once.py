"""A folder built once per test session and shared by the pytest-xdist workers."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """The folder ``name`` after ``build(folder)``, run by the first worker that asks.

    It is built in place (a venv holds its own path: no build-then-rename), so a
    ``done`` file tells a finished folder from one whose build failed.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: the session fixture suffices
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    shared = tmp_path_factory.getbasetemp().parent  # one per session, seen by every worker
    folder = shared / name
    with FileLock(shared / f"{name}.lock"):
        if (folder / "done").exists():
            return folder
        if folder.exists():
            pytest.fail(f"building {name} failed in another test: see its error")
        folder.mkdir()
        build(folder)
        (folder / "done").touch()
    return folder
