"""The checks that need an NVIDIA GPU, run by ``make gpu-check`` once one is found.

The GPU machines this project gets have no network, and a Python of their own with a CUDA
build of torch and most of the test tools, but not remat's other needs. So the check runs
with that Python as it is, if its torch is in the range ``pyproject.toml`` declares and can
use the GPU. It installs the few packages that Python lacks (`CARRIED`) from the wheels that
``make gpu-wheels`` downloaded on a machine with network, with ``pip --no-index``, and then
remat from this tree, both into one folder put on ``PYTHONPATH``. Then it runs the whole test
suite: the CUDA tests (the ``cuda`` marker, on the corpora's ``device="cuda"`` cases too;
none may skip) and the rest; the benchmark suite, whose memory columns then come from
the CUDA allocator; and ``benchmarks.gpu_steps``, the step times of the reference GPT and
a Hugging Face Llama. Writes ``gpu-check-report.md`` and the logs into ``--out``; exits 1 if
a check failed, or if that Python's torch cannot be used.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
REPORT = "gpu-check-report.md"
# What the GPU image's Python lacks, at the versions requirements-dev.txt pins.
CARRIED = (
    "optree",  # remat's dependency
    "torch-remat",  # a peer the benchmark suite compares with
    # hatchling builds remat from this tree, so that the suite tests the installed package
    # as make test does; tomlkit and trove-classifiers are its own needs.
    "hatchling",
    "tomlkit",
    "trove-classifiers",
)
# Test files that need what the GPU image lacks and test nothing of the device: make test
# runs them wherever remat is developed.
LEFT_OUT = {
    "tests/test_site.py": "the docs build: mkdocs and its plugins are not there",
    "tests/test_package.py": "the release checks: twine is not there, and remat installed "
    "on PYTHONPATH would shadow the wheel under test",
}
# pytest plugins of the GPU image that the suite does not use, kept off: pytest-benchmark 5.1
# warns at start-up when xdist is on, and the suite's warnings-as-errors stops pytest there.
PLUGINS_OFF = ("benchmark",)
# The GPU image's Python and platforms, for `make gpu-wheels`.
WHEEL_PYTHON = "3.12"
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Run by the Python under test: what its torch is, and whether it sees the GPU.
PROBE = """\
import json, torch
cuda = torch.cuda.is_available()
found = {"torch": torch.__version__, "cuda": cuda}
if cuda:
    properties = torch.cuda.get_device_properties(0)
    found.update(
        device=properties.name,
        capability=f"{properties.major}.{properties.minor}",
        gib=properties.total_memory / 2**30,
        count=torch.cuda.device_count(),
        cuda_version=torch.version.cuda,
    )
print(json.dumps(found))
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(names: Sequence[str] = CARRIED) -> list[str]:
    """``name==version`` for each of ``names``, as requirements-dev.txt pins it."""
    pinned = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pinned[_canonical(name)] = version
    return [f"{name}=={pinned[_canonical(name)]}" for name in names]


def download_command(python: str, folder: Path) -> list[str]:
    """The pip command that fetches `CARRIED`'s wheels for the GPU image into ``folder``."""
    pip = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    target = ["--python-version", WHEEL_PYTHON, "--implementation", "cp"]
    target += [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
    return [*pip, *target, "--dest", str(folder), *pins()]


def carried_wheels(folder: Path) -> list[Path]:
    """The wheel in ``folder`` for each pin of `CARRIED`, or SystemExit naming the missing."""
    found, missing = [], []
    for pin in pins():
        name, version = pin.split("==")
        # A wheel's name starts with its project's name (- and . as _) and its version.
        prefix = f"{_canonical(name).replace('-', '_')}-{version}-"
        wheels = [w for w in sorted(folder.glob("*.whl")) if w.name.lower().startswith(prefix)]
        found += wheels[:1]
        missing += [] if wheels else [pin]
    if missing:
        raise SystemExit(
            f"gpu-check: no wheel for {', '.join(missing)} in {folder}/. This machine has no "
            "network: run `make gpu-wheels` on one that has, and bring that folder along with "
            "the tree."
        )
    return found


def torch_range() -> str:
    """The torch requirement of remat's ``pyproject.toml``, such as ``>=2.10``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if re.match(r"torch(?![\w.-])", d)]
    return spec.removeprefix("torch").strip()


def cuda_machine(python: str) -> list[str]:
    """What runs the check, or SystemExit if ``python``'s torch cannot be used for it."""
    from packaging.specifiers import SpecifierSet

    wanted = torch_range()
    fix = (
        f"Run make gpu-check PYTHON=/path/to/python3, for a Python whose torch is a CUDA "
        f"build of torch{wanted}."
    )
    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu-check: {python} cannot import torch ({last}). {fix}")
    found = json.loads(probe.stdout)
    if not SpecifierSet(wanted).contains(found["torch"], prereleases=True):
        raise SystemExit(
            f"gpu-check: {python} has torch {found['torch']}, outside the range remat "
            f"supports (torch{wanted}, from pyproject.toml). {fix}"
        )
    if not found["cuda"]:
        raise SystemExit(
            f"gpu-check: an NVIDIA GPU is here, but torch {found['torch']} in {python} "
            "cannot use it (torch.cuda.is_available() is False: a CPU build, or a driver "
            f"older than its CUDA). {fix}"
        )
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
    return [
        f"device: {found['device']} (compute capability {found['capability']}, "
        f"{found['gib']:.0f} GiB), {found['count']} visible",
        f"torch {found['torch']}, CUDA {found['cuda_version']}, driver "
        f"{driver[0] if driver else 'unknown'}; {python}",
    ]


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

    @property
    def key(self) -> str:
        """What ``--only`` calls it: its log's name, ``cuda`` for ``cuda.log``."""
        return Path(self.log).stem


def setup(python: str, out: Path, wheels: Sequence[Path]) -> list[Check]:
    """The installs into ``out/site``, from files only: pip never looks at an index."""
    pip = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(out / "site")]
    return [
        Check("install the carried wheels", [*pip, *map(str, wheels)], "install-wheels.log"),
        # Built by the hatchling just installed, found on PYTHONPATH (`environment`).
        Check("install remat", [*pip, "--no-build-isolation", str(ROOT)], "install-remat.log"),
    ]


def checks(python: str, out: Path, workers: int) -> list[Check]:
    """The test runs and the bench, in the order they run (the bench takes the longest)."""

    def pytest(junit: str, *args: str) -> list[str]:
        # -P: the tree is not on sys.path, so the tests import remat as installed.
        ignore = [f"--ignore={path}" for path in LEFT_OUT]
        off = [arg for plugin in ("cacheprovider", *PLUGINS_OFF) for arg in ("-p", f"no:{plugin}")]
        run = [python, "-P", "-m", "pytest", *off, "-n", str(workers)]
        return [*run, *ignore, *args, "tests", f"--junitxml={out / junit}"]

    return [
        Check("CUDA tests", pytest("cuda.xml", "-m", "cuda", "-v"), "cuda.log", "cuda.xml"),
        Check("other tests", pytest("other.xml", "-m", "not cuda"), "other.log", "other.xml"),
        # What make bench runs, with this Python: the results go to the report's folder.
        Check(
            "bench", [python, "-m", "benchmarks.suite", "--out", str(out / "bench")], "bench.log"
        ),
        # Step times where Python issues the kernels: the reference GPT and an HF Llama.
        Check("GPU steps", [python, "-m", "benchmarks.gpu_steps"], "gpu-steps.log"),
    ]


def environment(out: Path) -> dict[str, str]:
    """The environment every command runs in: the installs first on the path, no index."""
    path = [str(out / "site"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PIP_NO_INDEX": "1"}


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
    elif check.name == "bench":
        results = out / "bench" / "results.md"
        if not results.exists() or "Memory: CUDA allocator" not in results.read_text():
            check.problem = "the bench did not measure with the CUDA allocator"


def run(check: Check, out: Path) -> None:
    print(f"gpu-check: {check.name}: {shlex.join(check.command)}", flush=True)
    start = time.perf_counter()
    with (out / check.log).open("w") as log:
        done = subprocess.run(
            check.command,
            cwd=ROOT,
            env=environment(out),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    check.returncode, check.seconds = done.returncode, time.perf_counter() - start
    judge(check, out)
    print(f"gpu-check: {check.name}: {'ok' if check.ok else check.problem}", flush=True)


def report(
    machine: list[str],
    done: list[Check],
    out: Path,
    planned: int | None = None,
    skipped: Sequence[str] = (),
) -> str:
    """The Markdown report: machine, one row per check, what was left out, the bench's tables.
    ``skipped``: the checks that ``--only`` left out."""
    complete = planned is None or len(done) == planned
    verdict = "PASS" if complete and all(c.ok for c in done) else "FAIL"
    if skipped and verdict == "PASS":
        verdict = "PASS, in part"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# make gpu-check: {verdict}", "", f"{when}.", "", *[f"- {m}" for m in machine]]
    if skipped:
        lines += [f"- not run (`--only`): {', '.join(skipped)}"]
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
    if not complete:
        lines += ["", f"Stopped after {done[-1].name}: {planned - len(done)} checks not run."]
    lines += ["", "Left out (make test runs them):", ""]
    lines += [f"- {path}: {why}" for path, why in LEFT_OUT.items()]
    lines += ["", "Commands:", ""]
    lines += [f"- {c.name}: `{shlex.join(c.command)}`" for c in done]
    results = out / "bench" / "results.md"
    if results.exists():
        lines += ["", "## bench", "", results.read_text()]
    steps = out / "gpu-steps.log"
    if steps.exists():
        lines += ["", "## GPU steps", "", steps.read_text()]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the report and logs go")
    parser.add_argument("--wheels", type=Path, required=True, help="the carried wheels' folder")
    parser.add_argument(
        "--download", action="store_true", help="download the wheels into --wheels, and stop"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the Python under test (default: this one)"
    )
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument(
        "--only",
        help="the checks to run, by name, comma-separated: cuda, other, bench, gpu-steps "
        "(default: all; the installs always run)",
    )
    args = parser.parse_args(argv)
    if args.download:
        return subprocess.run(download_command(args.python, args.wheels), check=False).returncode
    if args.out is None:
        parser.error("--out is required")
    out = args.out.resolve()
    todo, skipped = checks(args.python, out, args.workers), []
    if args.only:
        keys = args.only.split(",")
        unknown = sorted(set(keys) - {c.key for c in todo})
        if unknown:
            parser.error(
                f"--only: no check named {', '.join(unknown)}; the checks are "
                f"{', '.join(c.key for c in todo)}"
            )
        skipped = [c.name for c in todo if c.key not in keys]
        todo = [c for c in todo if c.key in keys]
    machine = cuda_machine(args.python)
    wheels = carried_wheels(args.wheels.resolve())
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "site", ignore_errors=True)
    planned = [*setup(args.python, out, wheels), *todo]
    done: list[Check] = []
    for check in planned:
        run(check, out)
        done.append(check)
        if check.name.startswith("install") and not check.ok:
            break  # nothing can run without its installs
    (out / REPORT).write_text(report(machine, done, out, len(planned), skipped))
    passed = len(done) == len(planned) and all(c.ok for c in done)
    print(f"gpu-check: {'all checks passed' if passed else 'FAILED'}; report: {out / REPORT}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
