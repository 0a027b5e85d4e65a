"""The supported versions are one list: the Makefile's, which `make compat` runs. The package
metadata, CI, the README and docs/versions.md say the same, and the pins are among them."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _read(name: str) -> str:
    return (ROOT / name).read_text()


def _make_variable(name: str) -> list[str]:
    (value,) = re.findall(rf"^{name} := (.*)$", _read("Makefile"), re.M)
    return value.split()


def _pinned(package: str) -> str:
    (version,) = re.findall(rf"^{package}==(\S+)$", _read("requirements-dev.txt"), re.M)
    return version


def _requirement(package: str) -> Requirement:
    (dependencies,) = re.findall(r"^dependencies = \[(.*)\]$", _read("pyproject.toml"), re.M)
    found = [Requirement(r) for r in re.findall(r'"([^"]+)"', dependencies)]
    (requirement,) = [r for r in found if r.name == package]
    return requirement


TORCH = _make_variable("TORCH_VERSIONS")
OLDEST, NEWEST = TORCH[0], TORCH[-1]
CI = _read(".ci/run")
CI_LEGS = re.findall(r'^    "(TORCH=[^"]+)"', CI, re.M)  # each ``make compat`` CI runs
(CI_TRANSFORMERS,) = re.findall(rf"^TORCH={OLDEST} TRANSFORMERS=(\S+)$", "\n".join(CI_LEGS), re.M)


def _minor(version: str) -> tuple[int, int]:
    release = Version(version).release
    return release[0], release[1]


def test_make_compat_runs_consecutive_minor_releases_the_pin_among_them():
    """One patch release per minor, consecutive minors, oldest first; the dev pin is one."""
    minors = [_minor(v) for v in TORCH]
    assert minors == [(minors[0][0], minors[0][1] + i) for i in range(len(minors))]
    assert _pinned("torch") in TORCH


def test_pyproject_declares_exactly_the_tested_torch_range():
    """``torch>=`` the oldest minor release tested, and no upper bound (none is known to break)."""
    assert str(_requirement("torch").specifier) == ">={}.{}".format(*_minor(OLDEST))


def test_ci_runs_the_pins_the_oldest_and_the_newest():
    """``make test`` (the pins), then every test on the oldest torch with the oldest
    transformers, and on the newest torch with the pinned one."""
    runs = re.findall(r"^ *run (.*)$", CI, re.M)
    assert runs == ["make test", "make compat $leg"]
    assert [f"TORCH={OLDEST} TRANSFORMERS={CI_TRANSFORMERS}", f"TORCH={NEWEST}"] == CI_LEGS
    assert Version(CI_TRANSFORMERS) < Version(_pinned("transformers"))


def test_readme_and_docs_name_the_tested_versions():
    """The table in the README and in docs/versions.md: the ranges and each version tested."""
    (python,) = re.findall(r'^requires-python = "(.*)"$', _read("pyproject.toml"), re.M)
    transformers = (CI_TRANSFORMERS, _pinned("transformers"))
    torch_range = "{}.{}".format(*_minor(OLDEST)), "{}.{}".format(*_minor(NEWEST))
    rows = [
        f"| torch | {torch_range[0]} to {torch_range[1]} (`torch{_requirement('torch').specifier}`)"
        f" | {', '.join(TORCH)} |",
        "| transformers (optional) | {} to {} | {} (with torch {}), {} |".format(
            *(".".join(v.split(".")[:2]) for v in transformers),
            transformers[0],
            OLDEST,
            transformers[1],
        ),
        f"| Python | {python.removeprefix('>=')} or later (`requires-python`) |",
    ]
    for page in ("README.md", "docs/versions.md"):
        text = _read(page)
        assert [row for row in rows if row not in text] == [], page
