"""The docs site: ``mkdocs build --strict`` passes, and what it renders is there.

The build runs once per session (make test's docs build is this one). It executes every
notebook in notebooks/ (mkdocs-jupyter, ``allow_errors: false``): a cell that raises
fails the build, so a failing notebook fails these tests.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import os
import re
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
from mkdocs.structure.files import File, Files
from mkdocs_jupyter.plugin import NotebookFile

from remat import policies
from tests.built_once import built_once

# One worker builds the site and runs these (make test: --dist loadgroup); the build runs
# every notebook, about 40 s alone on 2 cores, longer while other tests run.
pytestmark = [pytest.mark.xdist_group("site"), pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
IMAGE = re.compile(r'<img\b[^>]*\bsrc="([^"]+)"')
PROMPT = re.compile(r"In(?:&nbsp;|\s)\[([^\]]*)\]:")
_SPEC = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
assert _SPEC is not None
assert _SPEC.loader is not None
mkdocs_hooks = importlib.util.module_from_spec(_SPEC)  # loaded by path, as mkdocs loads it
_SPEC.loader.exec_module(mkdocs_hooks)


def _build(folder: Path) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MKDOCS_JUPYTER_CACHE": "false"}
    done = subprocess.run(
        [*command, "--site-dir", str(folder / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The built site."""
    return built_once(tmp_path_factory, worker_id, "site", _build) / "site"


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, from its header."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_page_shows_its_plots(site: Path, notebook: str) -> None:
    """Each tutorial page holds its matplotlib figures, as PNGs that decode."""
    page = site / "tutorials" / notebook / "index.html"
    sources = IMAGE.findall(page.read_text())
    pngs = []
    for source in sources:
        if source.startswith("data:image/png;base64,"):
            pngs.append(base64.b64decode(source.split(",", 1)[1], validate=True))
        elif not source.startswith("data:"):
            pngs.append((page.parent / source).read_bytes())
    assert pngs, f"no image on {page}"
    for png in pngs:
        width, height = _png_size(png)
        assert min(width, height) > 100


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_page_ran_every_cell(site: Path, notebook: str) -> None:
    """Every code cell of the notebook shows an execution count on its page."""
    cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    prompts = PROMPT.findall((site / "tutorials" / notebook / "index.html").read_text())
    assert prompts == [str(i) for i in range(1, len(code) + 1)]


def test_notebook_links_point_at_pages(site: Path) -> None:
    """The notebooks' links to docs/*.md lead to the built pages (mkdocs_hooks.py)."""
    found = 0
    for notebook in NOTEBOOKS:
        source = (ROOT / "notebooks" / f"{notebook}.ipynb").read_text()
        html = (site / "tutorials" / notebook / "index.html").read_text()
        assert not re.findall(r'href="[^"]*\.md[#"]', html), f"a link to a .md file in {notebook}"
        for name, anchor in re.findall(r"\]\(\.\./docs/([\w-]+)\.md(#[\w-]+)?\)", source):
            assert f'href="../../{name}/{anchor}"' in html
            assert (site / name / "index.html").is_file()
            found += 1
    assert found >= 5


def test_api_reference_lists_the_models_api_and_every_policy(site: Path) -> None:
    """The API page documents remat.apply, remat.checkpoint and all of remat.policies."""
    html = (site / "api" / "index.html").read_text()
    documented = set(re.findall(r'id="(remat(?:\.policies)?\.\w+)"', html))
    expected = {f"remat.policies.{name}" for name in policies.__all__}
    assert {"remat.apply", "remat.checkpoint"} | expected <= documented


def _linked(html: str, src_uri: str = "tutorials/01_quickstart.ipynb") -> str:
    files = Files([File(p, "docs", "site", True) for p in ("guide.md", src_uri)])
    if src_uri.endswith(".ipynb"):  # a page, as mkdocs-jupyter makes it
        notebook = NotebookFile(files.get_file_from_path(src_uri), True, "site")
        files = Files([files.get_file_from_path("guide.md"), notebook])
    page = types.SimpleNamespace(file=files.get_file_from_path(src_uri))
    return mkdocs_hooks.on_page_content(html, page, None, files)  # type: ignore[arg-type]


def test_hook_points_notebook_links_at_pages_and_warns_on_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Relative .md links in a notebook become page URLs; one to no page is a warning."""
    assert _linked('<a href="../docs/guide.md#pytrees">') == '<a href="../../guide/#pytrees">'
    untouched = '<a href="https://x.org/a.md"><a href="#top"><a href="/abs.md">'
    assert _linked(untouched) == untouched
    assert _linked('<a href="../docs/guide.md">', "guide.md") == '<a href="../docs/guide.md">'
    with caplog.at_level(logging.WARNING, "mkdocs.hooks.notebook_links"):
        assert _linked('<a href="../docs/gone.md">') == '<a href="../docs/gone.md">'
        assert _linked('<a href="other.md">') == '<a href="other.md">'
    assert [r.getMessage() for r in caplog.records] == [
        "tutorials/01_quickstart.ipynb links to ../docs/gone.md, which is no page",
        "tutorials/01_quickstart.ipynb links to other.md, which is no page",
    ]
