"""The release artifacts: the sdist and the wheel build offline from this tree, pass
``twine check``, hold what they should, and the wheel installed in a fresh venv imports
with warnings as errors and leaves torch as it was outside remat regions.

The fresh venv has no pip and no packages of its own (``venv --without-pip``: 0.05 s,
against 4 s with pip). The dev venv's pip installs the wheel into it with ``--no-deps``,
and a ``.pth`` file shows it the dev venv's packages, remat's own excepted, so it finds
the pinned CPU torch and optree. Resolving the dependencies from an index would fetch
torch again (the CUDA build: gigabytes), and ``--system-site-packages`` would show the
base interpreter's packages, not the dev venv's, which hold torch.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import remat
from tests.built_once import built_once

ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).resolve().parent / "import_probe.py"


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _purelib(python: Path | str) -> Path:
    source = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run(python, "-c", source).strip())


def _build_and_install(root: Path) -> None:
    """Build the sdist, the wheel from it, and install the wheel in ``root/venv``."""
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", root / "dist", ROOT)
    deps = root / "deps"  # the dev venv's packages, remat's own excepted
    deps.mkdir()
    dev = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    for entry in sorted(p for site in dev for p in site.iterdir()):
        if not re.fullmatch(r"remat(-.*\.dist-info)?", entry.name):
            (deps / entry.name).symlink_to(entry)
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    (_purelib(python) / "dev_deps.pth").write_text(f"{deps}\n")
    (wheel,) = (root / "dist").glob("*.whl")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with ``dist/`` (sdist and wheel) and ``venv/`` (the wheel installed)."""
    return built_once(tmp_path_factory, "package", _build_and_install)


def _python(built: Path) -> Path:
    return built / "venv" / "bin" / "python"


def test_distributions_pass_twine_check(built: Path) -> None:
    """``twine check --strict`` passes the sdist and the wheel."""
    dists = sorted((built / "dist").iterdir())
    assert sorted(p.suffix for p in dists) == [".gz", ".whl"]
    _run(sys.executable, "-m", "twine", "check", "--strict", *dists)


def test_wheel_holds_the_package_license_and_version(built: Path) -> None:
    """The wheel holds every module, py.typed and LICENSE; its version is remat.__version__."""
    (wheel,) = (built / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"remat-{remat.__version__}.dist-info"
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    package = {f"remat/{p.name}" for p in (ROOT / "remat").glob("*.py")} | {"remat/py.typed"}
    assert {n for n in names if not n.startswith(info)} == package
    assert (metadata["Name"], metadata["Version"]) == ("remat", remat.__version__)
    assert metadata["License-Expression"] == "MIT"
    assert license_text == (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")


def test_sdist_holds_sources_tests_and_release_files(built: Path) -> None:
    """The sdist holds the package, the tests, LICENSE, README.md and CHANGELOG.md."""
    (sdist,) = (built / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    release = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "remat/__init__.py"}
    tests = {f"tests/{name}" for name in ("test_package.py", "import_probe.py", "built_once.py")}
    assert release | tests <= names


def test_changelog_names_the_version() -> None:
    """CHANGELOG.md starts with Unreleased, then the release remat.__version__ names."""
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[:2] == ["Unreleased", remat.__version__]


def test_installed_wheel_imports_silently(built: Path, tmp_path: Path) -> None:
    """``python -W error -c "import remat"`` in the fresh venv imports the wheel's remat and
    prints nothing else: no warning, no log line (torch logs through `logging`, to stderr)."""
    source = "import remat; print(remat.__file__)"
    args = [_python(built), "-I", "-W", "error", "-c", source]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert (done.returncode, done.stderr) == (0, "")
    assert Path(done.stdout.strip()).is_relative_to(built / "venv")


def test_import_leaves_fsdp_to_the_program(built: Path, tmp_path: Path) -> None:
    """remat does not import ``torch.distributed.fsdp`` (most of a second): a program
    with FSDP2 units has imported it already, and remat finds it there."""
    source = "import sys, remat; print('torch.distributed.fsdp' in sys.modules)"
    assert _run(_python(built), "-I", "-c", source, cwd=tmp_path) == "False\n"


def test_installed_wheel_meets_its_requirements(built: Path, tmp_path: Path) -> None:
    """The fresh venv satisfies each requirement the wheel declares (installed --no-deps)."""
    source = (
        "import importlib.metadata as m\n"
        "from packaging.requirements import Requirement\n"
        "for r in map(Requirement, m.requires('remat')):\n"
        "    assert m.version(r.name) in r.specifier, (r, m.version(r.name))\n"
        "    print(r.name)\n"
    )
    out = _run(_python(built), "-I", "-c", source, cwd=tmp_path)
    assert sorted(out.split()) == ["optree", "torch"]


def test_import_changes_nothing_in_torch_outside_regions(built: Path, tmp_path: Path) -> None:
    """Importing remat: same results bitwise, no mode or hook, new ops only in remat::."""
    prefix = f"{_purelib(_python(built))}{os.sep}"
    assert _run(_python(built), "-I", "-W", "error", PROBE, prefix, cwd=tmp_path) == "ok\n"
