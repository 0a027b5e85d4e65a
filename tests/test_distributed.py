"""remat under DDP, FSDP and FSDP2: 2 CPU processes on gloo, bitwise equal to plain training.

The two ranks are started once for the module (once per test session under xdist: the
first worker to need them runs them, the others wait on a lock and read the results).
They run every scenario of ``tests/distributed_scenarios.py``; each test here asserts
one scenario on both ranks. Rendezvous is on a file in a temporary directory, every
collective times out after 30 s and the whole run after `DEADLINE` seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import remat
from tests import distributed_scenarios as scenarios

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

WORLD = 2
DEADLINE = 240  # seconds for both ranks to run every scenario (pytest-timeout: 300 per test)
TRAINING = [
    name
    for name in scenarios.SCENARIOS
    if not name.startswith("memory-") and name != "fsdp2-step-between-forward-and-backward"
]
MEMORY = [name for name in scenarios.SCENARIOS if name.startswith("memory-")]


def _spawn(directory: Path) -> None:
    """Run both ranks to the end, or kill them at the deadline; logs land in ``directory``."""
    paths = [str(Path(remat.__file__).parent.parent), str(Path(__file__).parent.parent)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    rendezvous = directory / "rendezvous"
    ranks = []
    for rank in range(WORLD):
        with open(directory / f"log{rank}", "w") as log:
            argv = [sys.executable, scenarios.__file__, str(rank), str(WORLD), str(rendezvous)]
            ranks.append(
                subprocess.Popen(
                    [*argv, str(directory)], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
    codes = {}
    try:
        for rank, process in enumerate(ranks):
            codes[rank] = process.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        codes["timed out"] = DEADLINE
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    (directory / "exit.json").write_text(json.dumps(codes))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank found, per scenario (the ranks run once per session)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        directory = tmp_path_factory.getbasetemp().parent / "distributed"  # shared by workers
        directory.mkdir(exist_ok=True)
    else:
        directory = tmp_path_factory.mktemp("distributed")
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / "exit.json").exists():
            _spawn(directory)
    found = []
    for rank in range(WORLD):
        result = directory / f"rank{rank}.json"
        log = (directory / f"log{rank}").read_text()
        found.append({**(json.loads(result.read_text()) if result.exists() else {}), "log": log})
    found[0]["exit"] = json.loads((directory / "exit.json").read_text())
    return found


def _on_each_rank(ranks: list[dict[str, Any]], scenario: str) -> list[dict[str, Any]]:
    """Each rank's result for ``scenario``; fails with the rank's error or log tail."""
    results = []
    for rank, found in enumerate(ranks):
        if scenario not in found:
            pytest.fail(
                f"rank {rank} did not finish {scenario!r}; its log:\n{found['log'][-4000:]}"
            )
        if "error" in found[scenario]:
            pytest.fail(f"rank {rank} raised in {scenario!r}:\n{found[scenario]['error']}")
        results.append(found[scenario])
    return results


def test_ranks_exit_cleanly(ranks):
    """Both ranks run every scenario and exit with status 0 before the deadline."""
    assert ranks[0]["exit"] == {"0": 0, "1": 0}, ranks[0]["log"][-4000:] + ranks[1]["log"][-4000:]


@pytest.mark.parametrize("scenario", TRAINING)
def test_training_equals_plain(ranks, scenario):
    """Losses, gradients, parameters and buffers after 2 steps equal plain training's bitwise."""
    for rank, result in enumerate(_on_each_rank(ranks, scenario)):
        assert result["differences"] == [], f"rank {rank}"


@pytest.mark.parametrize("setup", MEMORY)
def test_memory_held_per_block_equals_checkpoint(ranks, setup):
    """Each block keeps what torch.utils.checkpoint's block keeps, and less than plain's."""
    for found in _on_each_rank(ranks, setup):
        held = {how: found[how]["held"] for how in scenarios.WRAPS}
        assert held["remat"] == held["checkpoint"]
        assert all(r < p for r, p in zip(held["remat"], held["plain"], strict=True))


def test_optimizer_step_between_forward_and_backward_raises(ranks):
    """FSDP2 re-gathers updated shards silently; remat raises instead of mixing values."""
    scenario = "fsdp2-step-between-forward-and-backward"
    for found in _on_each_rank(ranks, scenario):
        for where in ("inside", "around"):
            assert found[where]["plain"]["raised"] is None
            assert "FSDP2's sharded parameter" in found[where]["remat"]["raised"]
            assert "modified in place between the forward" in found[where]["remat"]["raised"]
