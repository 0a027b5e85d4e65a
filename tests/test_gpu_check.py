"""``make gpu-check`` skips cleanly without a GPU, and its report tells a failed check.

The GPU run itself needs a GPU; these tests cover what decides and reports.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
assert _SPEC is not None
assert _SPEC.loader is not None
gpu_check = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up
_SPEC.loader.exec_module(gpu_check)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
errors="{errors}" failures="{failures}" skipped="{skipped}" tests="{tests}"></testsuite>
</testsuites>"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path: Path) -> None:
    """With no GPU listed by nvidia-smi, make gpu-check prints why it skipped, and exits 0."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_CHECK_OUT={tmp_path / 'out'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("make gpu-check: skipped: no NVIDIA GPU on this machine")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs torch without CUDA")
def test_a_torch_without_cuda_stops_the_check_with_the_fix() -> None:
    """A GPU that this venv's torch cannot use stops the check, saying what to install."""
    with pytest.raises(SystemExit, match=r"cannot use it .* Install a CUDA build"):
        gpu_check.cuda_machine()


def _checks(out: Path, **junit: dict[str, int]) -> list:
    done = gpu_check.checks(out, "make")
    for check in done:
        check.returncode = 0
        if check.junit is not None:
            counts = {"errors": 0, "failures": 0, "skipped": 0, "tests": 3, **junit[check.junit]}
            (out / check.junit).write_text(JUNIT.format(**counts))
    return done


def test_report_passes_when_every_check_did(tmp_path: Path) -> None:
    """CUDA tests run, offload and RNG pass, the bench used the allocator: PASS."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.md").write_text("torch, cuda. Memory: CUDA allocator.\n")
    done = _checks(tmp_path, **{"cuda.xml": {"tests": 2}, "offload-rng.xml": {"skipped": 1}})
    for check in done:
        gpu_check.judge(check, tmp_path)
    assert [c.problem for c in done] == ["", "", ""]
    text = gpu_check.report(["device: X"], done, tmp_path)
    assert text.startswith("# make gpu-check: PASS\n")
    assert "| CUDA tests | ok | 2 | 0 | 0 |" in text
    assert "| offload and RNG tests | ok | 2 | 0 | 1 |" in text
    assert text.endswith("Memory: CUDA allocator.\n")


def test_report_fails_on_a_skipped_cuda_test_a_failure_or_a_cpu_bench(tmp_path: Path) -> None:
    """A skipped CUDA test, a failing test run, or a bench without the allocator: FAIL."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.md").write_text("torch, cpu. Memory: remat.memory.track.\n")
    junit = {"cuda.xml": {"skipped": 1}, "offload-rng.xml": {"failures": 1, "errors": 1}}
    done = _checks(tmp_path, **junit)
    done[1].returncode = 1
    for check in done:
        gpu_check.judge(check, tmp_path)
    assert [c.problem for c in done] == [
        "a CUDA test was skipped on a machine with a GPU",
        "exit status 1",
        "the bench did not measure with the CUDA allocator",
    ]
    text = gpu_check.report(["device: X"], done, tmp_path)
    assert text.startswith("# make gpu-check: FAIL\n")
    assert "| offload and RNG tests | exit status 1 | 1 | 1 (+1 errors) | 0 |" in text
