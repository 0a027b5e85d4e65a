"""The demo (`make demo`) runs end to end at a tiny size and shows what remat promises."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import remat
from tests.helpers import import_benchmark

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *("--blocks", "2", "--width", "32", "--heads", "2", "--seq", "16", "--vocab", "64"),
    *("--batch", "2", "--steps", "2", "--warmup", "1"),
    *("--threads", "1"),  # tiny ops; two threads only fight the other pytest worker
]


def _import_demo() -> ModuleType:
    return import_benchmark("demo")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def run() -> tuple[dict[str, Any], str]:
    out, threads = io.StringIO(), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out):
            results = _import_demo().main(TINY)
    finally:
        torch.set_num_threads(threads)
    return {r.mode: r for r in results}, out.getvalue()


def test_modes_cover_every_policy(run: tuple[dict[str, Any], str]) -> None:
    """The modes are plain, torch's checkpoint, and remat with every policy object."""
    results, _ = run
    policies = [
        name
        for name in remat.policies.__all__
        if isinstance(getattr(remat.policies, name), remat.policies.Policy)
    ]
    assert {"remat save_nothing", "remat save_everything"} <= {f"remat {p}" for p in policies}
    assert list(results) == ["plain", "torch.utils.checkpoint", *(f"remat {p}" for p in policies)]


def test_tables_have_a_row_per_mode(run: tuple[dict[str, Any], str]) -> None:
    """Both printed tables, memory and time then losses, have one row for each mode."""
    results, printed = run
    assert "| mode " in printed
    for mode in results:
        assert sum(line.startswith(f"| {mode} ") for line in printed.splitlines()) == 2


def test_save_nothing_holds_less_than_plain(run: tuple[dict[str, Any], str]) -> None:
    """After the forward, `remat` with save_nothing holds fewer bytes than plain autograd."""
    results, _ = run
    assert results["remat save_nothing"].held < results["plain"].held


def test_save_everything_holds_what_plain_holds(run: tuple[dict[str, Any], str]) -> None:
    """`remat` with save_everything holds exactly the bytes plain autograd holds."""
    results, _ = run
    assert results["remat save_everything"].held == results["plain"].held


def test_losses_and_weights_equal_plain(run: tuple[dict[str, Any], str]) -> None:
    """Every mode, dropout included, ends with plain's loss and weights, bit for bit."""
    results, printed = run
    for result in results.values():
        assert result.loss == results["plain"].loss
        assert result.same_loss
        assert result.same_weights
    assert "NO" not in printed
