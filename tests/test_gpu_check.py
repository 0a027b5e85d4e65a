"""``make gpu-check``: it skips cleanly without a GPU; with one, it works offline with the
machine's own Python, refuses a torch it cannot use, and its report tells a failed check.

The GPU run itself needs a GPU. Here a fake ``nvidia-smi`` lists one and a fake Python stands
in for the GPU machine's: it answers the torch probe as a CUDA torch would, runs pip for real
(with every index unreachable), and records the test and bench commands instead of running
them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

import remat

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
assert _SPEC is not None
assert _SPEC.loader is not None
gpu_check = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up
_SPEC.loader.exec_module(gpu_check)

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
errors="{errors}" failures="{failures}" skipped="{skipped}" tests="{tests}"></testsuite>
</testsuites>"""

NVIDIA_SMI = """#!/bin/sh
case "$1" in
    -L) echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)' ;;
    *) echo '580.159.04' ;;
esac
"""

# The GPU machine's Python: each call is logged; the driver runs in the real Python, told to
# use this one; the probe sees `FOUND`; pip runs; pytest and the bench write what they would.
FAKE_PYTHON = """#!{real}
import json, os, sys
from pathlib import Path

REAL, args = {real!r}, sys.argv[1:]
with open(os.environ["FAKE_PYTHON_LOG"], "a") as log:
    keep = ("PYTHONPATH", "PIP_NO_INDEX")
    print(json.dumps({{"args": args, **{{k: os.environ.get(k) for k in keep}}}}), file=log)
if args[0] == "tools/gpu_check.py":
    os.execv(REAL, [REAL, *args, "--python", sys.argv[0]])
if args[0] == "-c":
    print(os.environ["FAKE_TORCH"])
    sys.exit()
module = args[args.index("-m") + 1]
if module == "pip":
    os.execv(REAL, [REAL, *args])
if module == "pytest":
    (junit,) = [a.split("=", 1)[1] for a in args if a.startswith("--junitxml=")]
    Path(junit).write_text('<testsuite tests="5" failures="0" errors="0" skipped="0"/>')
if module == "benchmarks.suite":
    out = Path(args[args.index("--out") + 1])
    out.mkdir(parents=True)
    (out / "results.md").write_text("Memory: CUDA allocator.\\n")
if module == "benchmarks.gpu_steps":
    print("remat save_matmuls / torch SAC: 1.000x")
"""
FOUND = {
    "torch": "2.11.0+cu130",
    "cuda": True,
    "device": "NVIDIA H100 80GB HBM3",
    "capability": "9.0",
    "gib": 79.2,
    "count": 1,
    "cuda_version": "13.0",
}


def _fake_machine(tmp_path: Path, found: dict[str, object]) -> dict[str, str]:
    """A fake nvidia-smi and Python in ``tmp_path/bin``; the environment that finds them.

    pip reads no config file and its index is a closed port: any index access fails.
    """
    (tmp_path / "bin").mkdir()
    for name, text in {"nvidia-smi": NVIDIA_SMI, "python3": FAKE_PYTHON}.items():
        (tmp_path / "bin" / name).write_text(text.format(real=sys.executable))
        (tmp_path / "bin" / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHONPATH"))}
    return {
        **env,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "FAKE_PYTHON_LOG": str(tmp_path / "calls.jsonl"),
        "FAKE_TORCH": json.dumps(found),
    }


def _wheel(folder: Path, pin: str) -> Path:
    """A wheel of ``pin`` that installs its metadata only (nothing to import)."""
    name, version = pin.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(
        f"{f},,\n" for f in [*files, f"{dist}.dist-info/RECORD"]
    )
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def _make(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )


@needs_make
def test_make_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path: Path) -> None:
    """With no GPU listed by nvidia-smi, make gpu-check prints why it skipped, and exits 0."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = _make("gpu-check", f"GPU_CHECK_OUT={tmp_path / 'out'}", env=env)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("make gpu-check: skipped: no NVIDIA GPU on this machine")
    assert not (tmp_path / "out").exists()


@needs_make
def test_make_gpu_check_offline_uses_the_machines_python_and_the_wheels(tmp_path: Path) -> None:
    """With a GPU: the machine's Python, pip with --no-index from the pinned wheels only,
    remat built from the tree, then the whole suite in two runs and the bench: PASS."""
    env = _fake_machine(tmp_path, FOUND)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    carried = [_wheel(wheels, pin) for pin in gpu_check.pins()]
    _wheel(wheels, "optree==0.1.0")  # a stale one, left alone
    out = tmp_path / "out"
    python = str(tmp_path / "bin" / "python3")
    done = _make(
        "gpu-check", f"PYTHON={python}", f"GPU_CHECK_OUT={out}", f"GPU_WHEELS={wheels}", env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.endswith(f"all checks passed; report: {out / gpu_check.REPORT}\n")
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["args"][:1] for c in calls[:2]] == [["tools/gpu_check.py"], ["-c"]]
    install = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--target"]
    site, workers = str(out / "site"), str(min(8, os.cpu_count() or 1))
    ignore = [f"--ignore={path}" for path in gpu_check.LEFT_OUT]
    off = ["-p", "no:cacheprovider", "-p", "no:benchmark"]
    pytest = [python, "-P", "-m", "pytest", *off, "-n", workers, *ignore]
    assert [[python, *c["args"]] for c in calls[2:]] == [
        [*install, site, *map(str, carried)],
        [*install, site, "--no-build-isolation", str(ROOT)],
        [*pytest, "-m", "cuda", "-v", "tests", f"--junitxml={out / 'cuda.xml'}"],
        [*pytest, "-m", "not cuda", "tests", f"--junitxml={out / 'other.xml'}"],
        [python, "-m", "benchmarks.suite", "--out", str(out / "bench")],
        [python, "-m", "benchmarks.gpu_steps"],
    ]
    for call in calls[2:]:
        assert (call["PIP_NO_INDEX"], call["PYTHONPATH"].split(os.pathsep)[0]) == ("1", site)
    pins = [*gpu_check.pins(), f"remat=={remat.__version__}"]
    installed = {p.name for p in (out / "site").glob("*.dist-info")}
    assert installed == {f"{p.replace('-', '_').replace('==', '-')}.dist-info" for p in pins}
    assert (out / "site" / "remat" / "__init__.py").read_text() == (
        ROOT / "remat" / "__init__.py"
    ).read_text()
    report = (out / gpu_check.REPORT).read_text()
    assert report.startswith("# make gpu-check: PASS\n")
    assert "- device: NVIDIA H100 80GB HBM3 (compute capability 9.0, 79 GiB), 1 visible\n" in report
    assert f"- torch 2.11.0+cu130, CUDA 13.0, driver 580.159.04; {python}\n" in report
    assert report.endswith("## GPU steps\n\nremat save_matmuls / torch SAC: 1.000x\n")


def test_make_gpu_check_runs_only_the_checks_named(tmp_path: Path) -> None:
    """GPU_CHECKS=cuda,gpu-steps: the installs, then those two; the report says what did not
    run, and passes only in part."""
    env = _fake_machine(tmp_path, FOUND)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for pin in gpu_check.pins():
        _wheel(wheels, pin)
    out, python = tmp_path / "out", str(tmp_path / "bin" / "python3")
    done = _make(
        "gpu-check",
        f"PYTHON={python}",
        f"GPU_CHECK_OUT={out}",
        f"GPU_WHEELS={wheels}",
        "GPU_CHECKS=cuda,gpu-steps",
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    run = [c["args"][c["args"].index("-m") + 1] for c in calls[2:]]
    assert run == ["pip", "pip", "pytest", "benchmarks.gpu_steps"]
    assert "-m cuda" in " ".join(calls[4]["args"])
    report = (out / gpu_check.REPORT).read_text()
    assert report.startswith("# make gpu-check: PASS, in part\n")
    assert "- not run (`--only`): other tests, bench\n" in report


def test_an_unknown_check_name_stops_before_anything_runs(tmp_path: Path, capsys) -> None:
    """--only with a name that is no check's: a usage error naming the checks, before the
    probe of torch (no GPU needed to see it)."""
    argv = ["--out", str(tmp_path), "--wheels", str(tmp_path), "--python", "/nonexistent"]
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main([*argv, "--only", "cuda,steps"])
    assert stopped.value.code == 2
    assert "--only: no check named steps; the checks are cuda, other, bench, gpu-steps" in (
        capsys.readouterr().err
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs torch without CUDA")
def test_a_torch_without_cuda_stops_the_check_with_the_fix() -> None:
    """A GPU that this Python's torch cannot use stops the check, saying what to run."""
    with pytest.raises(SystemExit, match=r"cannot use it \(.*\)\. Run make gpu-check PYTHON="):
        gpu_check.cuda_machine(sys.executable)


def test_a_torch_outside_the_supported_range_stops_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA torch older than pyproject.toml's range stops the check, naming the range."""
    env = _fake_machine(tmp_path, {**FOUND, "torch": "2.0.1+cu118"})
    for name in ("FAKE_PYTHON_LOG", "FAKE_TORCH"):
        monkeypatch.setenv(name, env[name])
    python = str(tmp_path / "bin" / "python3")
    with pytest.raises(SystemExit) as stopped:
        gpu_check.cuda_machine(python)
    assert str(stopped.value) == (
        f"gpu-check: {python} has torch 2.0.1+cu118, outside the range remat supports "
        f"(torch{gpu_check.torch_range()}, from pyproject.toml). Run make gpu-check "
        "PYTHON=/path/to/python3, for a Python whose torch is a CUDA build of "
        f"torch{gpu_check.torch_range()}."
    )


def test_the_torch_range_is_pyproject_s_and_holds_the_pinned_torch() -> None:
    """The range the check enforces is pyproject.toml's torch requirement; the pin is in it."""
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{gpu_check.torch_range()}"' in text
    assert SpecifierSet(gpu_check.torch_range()).contains(torch.__version__, prereleases=True)


def test_a_missing_wheel_stops_the_check_naming_make_gpu_wheels(tmp_path: Path) -> None:
    """Without the carried wheels the check names each missing pin and make gpu-wheels."""
    _wheel(tmp_path, gpu_check.pins()[0])
    with pytest.raises(SystemExit) as stopped:
        gpu_check.carried_wheels(tmp_path)
    message = str(stopped.value)
    assert message.startswith(f"gpu-check: no wheel for {', '.join(gpu_check.pins()[1:])} in ")
    assert "run `make gpu-wheels` on one that has" in message


@needs_make
def test_make_gpu_wheels_downloads_requirements_dev_pins_for_the_gpu_image(
    tmp_path: Path,
) -> None:
    """make gpu-wheels asks pip for requirements-dev.txt's pins of the carried packages, as
    wheels only, without their dependencies, for CPython 3.12 on manylinux x86-64."""
    env = _fake_machine(tmp_path, FOUND)
    python, wheels = str(tmp_path / "bin" / "python3"), str(tmp_path / "wheels")
    # The fake Python logs the pip call, then runs it: with no index, pip finds nothing.
    done = _make("gpu-wheels", f"PYTHON={python}", f"GPU_WHEELS={wheels}", env=env)
    assert done.returncode != 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    pinned = re.findall(r"^([\w.-]+==[\w.]+)", (ROOT / "requirements-dev.txt").read_text(), re.M)
    carried = [p for p in pinned if p.split("==")[0] in gpu_check.CARRIED]
    assert len(carried) == len(gpu_check.CARRIED)
    assert calls[-1]["args"] == [
        *("-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--python-version", "3.12", "--implementation", "cp"),
        *("--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"),
        *("--platform", "manylinux2014_x86_64", "--dest", wheels),
        *carried,
    ]


def _checks(out: Path, **junit: dict[str, int]) -> list:
    done = gpu_check.checks("python3", out, 8)
    for check in done:
        check.returncode = 0
        if check.junit is not None:
            counts = {"errors": 0, "failures": 0, "skipped": 0, "tests": 3, **junit[check.junit]}
            (out / check.junit).write_text(JUNIT.format(**counts))
    return done


def test_report_passes_when_every_check_did(tmp_path: Path) -> None:
    """CUDA tests run, none skipped; the other tests pass; the bench used the allocator: PASS."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.md").write_text("torch, cuda. Memory: CUDA allocator.\n")
    done = _checks(tmp_path, **{"cuda.xml": {"tests": 2}, "other.xml": {"skipped": 1}})
    for check in done:
        gpu_check.judge(check, tmp_path)
    assert [c.problem for c in done] == ["", "", "", ""]
    text = gpu_check.report(["device: X"], done, tmp_path, len(done))
    assert text.startswith("# make gpu-check: PASS\n")
    assert "| CUDA tests | ok | 2 | 0 | 0 |" in text
    assert "| other tests | ok | 2 | 0 | 1 |" in text
    assert "- tests/test_site.py: the docs build: mkdocs and its plugins are not there\n" in text
    assert text.endswith("Memory: CUDA allocator.\n")


def test_report_fails_on_a_skipped_cuda_test_a_failure_or_a_cpu_bench(tmp_path: Path) -> None:
    """A skipped CUDA test, a failing test run, or a bench without the allocator: FAIL."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.md").write_text("torch, cpu. Memory: remat.memory.track.\n")
    junit = {"cuda.xml": {"skipped": 1}, "other.xml": {"failures": 1, "errors": 1}}
    done = _checks(tmp_path, **junit)
    done[1].returncode = 1
    for check in done:
        gpu_check.judge(check, tmp_path)
    assert [c.problem for c in done] == [
        "a CUDA test was skipped on a machine with a GPU",
        "exit status 1",
        "the bench did not measure with the CUDA allocator",
        "",
    ]
    text = gpu_check.report(["device: X"], done, tmp_path)
    assert text.startswith("# make gpu-check: FAIL\n")
    assert "| other tests | exit status 1 | 1 | 1 (+1 errors) | 0 |" in text


def test_report_of_a_failed_install_fails_and_says_what_did_not_run(tmp_path: Path) -> None:
    """An install that failed stops the check: FAIL, with the count of checks not run."""
    (install, _), todo = (
        gpu_check.setup("python3", tmp_path, []),
        gpu_check.checks("python3", tmp_path, 8),
    )
    install.returncode = 1
    gpu_check.judge(install, tmp_path)
    text = gpu_check.report(["device: X"], [install], tmp_path, 2 + len(todo))
    assert text.startswith("# make gpu-check: FAIL\n")
    assert "| install the carried wheels | exit status 1 |" in text
    assert "Stopped after install the carried wheels: 5 checks not run.\n" in text


DETERMINISM_PROBE = """
import os
import pytest
import torch

@pytest.mark.cuda
def test_marked():
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"

def test_unmarked():
    assert not torch.are_deterministic_algorithms_enabled()
"""


def test_cuda_tests_run_with_deterministic_algorithms(tmp_path: Path) -> None:
    """tests/conftest.py runs each cuda-marked test, and only those, under deterministic
    algorithms, with cuBLAS's deterministic workspace set (what a GPU run needs to be bitwise)."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(DETERMINISM_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    done = subprocess.run(
        [*command, "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
