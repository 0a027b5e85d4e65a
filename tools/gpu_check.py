"""The checks that need an NVIDIA GPU, run by ``make gpu-check`` once one is found.

The CUDA-only tests (pytest marker ``cuda``), the offload and RNG tests (on a CUDA
machine remat also captures and replays the CUDA generators there), and ``make bench``,
whose memory columns then come from the CUDA allocator (``torch.cuda.memory_allocated``
and ``max_memory_allocated``). Writes ``gpu-check-report.md`` and the logs into ``--out``;
exits 1 if a check failed, or if the GPU is there but this venv's torch cannot use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

REPORT = "gpu-check-report.md"
# The venv's pytest, as make test runs it: the installed package is tested, not the tree.
PYTEST = [str(Path(sys.executable).with_name("pytest")), "-p", "no:cacheprovider"]


@dataclasses.dataclass
class Check:
    """One command of the check, and what came of it."""

    name: str
    command: list[str]
    log: str
    junit: str | None = None  # a pytest run's junit XML, for its counts
    returncode: int | None = None
    seconds: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.problem


def checks(out: Path, make: str) -> list[Check]:
    """The commands, in the order they run (the bench last: it takes the longest)."""

    def pytest(junit: str, *args: str) -> list[str]:
        return [*PYTEST, *args, "tests", f"--junitxml={out / junit}"]

    return [
        Check("CUDA tests", pytest("cuda.xml", "-m", "cuda", "-v", "-s"), "cuda.log", "cuda.xml"),
        Check(
            "offload and RNG tests",
            pytest("offload-rng.xml", "-n", "2", "-m", "not cuda", "-k", "offload or test_rng"),
            "offload-rng.log",
            "offload-rng.xml",
        ),
        Check("make bench", [make, "bench", f"BENCH_OUT={out / 'bench'}"], "bench.log"),
    ]


def junit_counts(path: Path) -> dict[str, int]:
    """passed, failed, errors and skipped, summed over a junit XML file's test suites."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures")}
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {
        "passed": total["tests"] - total["failures"] - errors - skipped,
        "failed": total["failures"],
        "errors": errors,
        "skipped": skipped,
    }


def judge(check: Check, out: Path) -> None:
    """Fill in ``counts`` and ``problem`` once ``check`` has run."""
    if check.junit is not None and (out / check.junit).exists():
        check.counts = junit_counts(out / check.junit)
    if check.returncode != 0:
        check.problem = f"exit status {check.returncode}"
    elif check.name == "CUDA tests" and (check.counts.get("skipped") or not check.counts):
        check.problem = "a CUDA test was skipped on a machine with a GPU"
    elif check.name == "make bench":
        results = out / "bench" / "results.md"
        if not results.exists() or "Memory: CUDA allocator" not in results.read_text():
            check.problem = "the bench did not measure with the CUDA allocator"


def run(check: Check, out: Path) -> None:
    print(f"gpu-check: {check.name}: {shlex.join(check.command)}", flush=True)
    start = time.perf_counter()
    with (out / check.log).open("w") as log:
        done = subprocess.run(check.command, stdout=log, stderr=subprocess.STDOUT, check=False)
    check.returncode, check.seconds = done.returncode, time.perf_counter() - start
    judge(check, out)
    print(f"gpu-check: {check.name}: {'ok' if check.ok else check.problem}", flush=True)


def report(machine: list[str], done: list[Check], out: Path) -> str:
    """The Markdown report: machine, one row per check, the bench's tables."""
    verdict = "PASS" if all(c.ok for c in done) else "FAIL"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# make gpu-check: {verdict}", "", f"{when}.", "", *[f"- {m}" for m in machine]]
    lines += ["", "| check | result | passed | failed | skipped | time | log |"]
    lines += ["|---|---|---:|---:|---:|---:|---|"]
    for c in done:
        counts = [str(c.counts[k]) if c.counts else "" for k in ("passed", "failed", "skipped")]
        if c.counts.get("errors"):
            counts[1] += f" (+{c.counts['errors']} errors)"
        result = "ok" if c.ok else c.problem
        lines.append(
            f"| {c.name} | {result} | {' | '.join(counts)} | {c.seconds:.0f} s | {c.log} |"
        )
    lines += ["", "Commands:", ""]
    lines += [f"- {c.name}: `{shlex.join(c.command)}`" for c in done]
    results = out / "bench" / "results.md"
    if results.exists():
        lines += ["", "## make bench", "", results.read_text()]
    return "\n".join(lines).rstrip() + "\n"


def cuda_machine() -> list[str]:
    """What runs the check, or SystemExit if this venv's torch cannot use the GPU."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            f"gpu-check: an NVIDIA GPU is here, but torch {torch.__version__} in this venv "
            "cannot use it (torch.cuda.is_available() is False: a CPU build, or a driver "
            "older than its CUDA). Install a CUDA build of the pinned torch into .venv (the "
            "Linux wheels on PyPI are CUDA builds), then run make gpu-check again."
        )
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
    driver_version = driver[0] if driver else "unknown"
    return [
        f"device: {name} (compute capability {major}.{minor}, {gib:.0f} GiB), "
        f"{torch.cuda.device_count()} visible",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver {driver_version}, "
        f"Python {sys.version.split()[0]}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the report and logs go")
    parser.add_argument("--make", default="make", help="the make that runs `make bench`")
    args = parser.parse_args(argv)
    machine = cuda_machine()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    done = checks(out, args.make)
    for check in done:
        run(check, out)
    (out / REPORT).write_text(report(machine, done, out))
    print(
        f"gpu-check: {'all checks passed' if all(c.ok for c in done) else 'FAILED'}; "
        f"report: {out / REPORT}"
    )
    return 0 if all(c.ok for c in done) else 1


if __name__ == "__main__":
    sys.exit(main())
