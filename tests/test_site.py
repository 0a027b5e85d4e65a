"""The docs site: ``mkdocs build --strict`` passes, and what it renders is there.

make test's docs build is this one. It runs every notebook in notebooks/ (mkdocs-jupyter,
``allow_errors: false``): a cell that raises fails the build, so a failing notebook fails
`test_site`. One test builds and checks the site (as subtests): the build takes one xdist
worker, and no test on the other worker waits for it.
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

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
IMAGE = re.compile(r'<img\b[^>]*\bsrc="([^"]+)"')
PROMPT = re.compile(r"In(?:&nbsp;|\s)\[([^\]]*)\]:")
_SPEC = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
assert _SPEC is not None
assert _SPEC.loader is not None
mkdocs_hooks = importlib.util.module_from_spec(_SPEC)  # loaded by path, as mkdocs loads it
_SPEC.loader.exec_module(mkdocs_hooks)


def _build(site: Path) -> None:
    # Not --quiet: it drops warnings before --strict counts them, and the build passes.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MKDOCS_JUPYTER_CACHE": "false"}
    done = subprocess.run(
        [*command, "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, from its header."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _assert_plots_shown(page: Path) -> None:
    """The page holds its matplotlib figures, as PNGs that decode."""
    pngs = []
    for source in IMAGE.findall(page.read_text()):
        if source.startswith("data:image/png;base64,"):
            pngs.append(base64.b64decode(source.split(",", 1)[1], validate=True))
        elif not source.startswith("data:"):
            pngs.append((page.parent / source).read_bytes())
    assert pngs, f"no image on {page}"
    for png in pngs:
        width, height = _png_size(png)
        assert min(width, height) > 100


def _assert_every_cell_ran(page: Path, notebook: Path) -> None:
    """Every code cell of the notebook shows its execution count on the page."""
    cells = json.loads(notebook.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert PROMPT.findall(page.read_text()) == [str(i) for i in range(1, len(code) + 1)]


def _assert_links_lead_to_pages(site: Path, page: Path, notebook: Path) -> int:
    """The notebook's links to docs/*.md lead to built pages (mkdocs_hooks.py)."""
    html = page.read_text()
    assert not re.findall(r'href="[^"]*\.md[#"]', html), "a link to a .md file"
    links = re.findall(r"\]\(\.\./docs/([\w-]+)\.md(#[\w-]+)?\)", notebook.read_text())
    for name, anchor in links:
        assert f'href="../../{name}/{anchor}"' in html
        assert (site / name / "index.html").is_file()
    return len(links)


@pytest.mark.timeout(600)  # the notebooks: about 40 s alone on 2 cores, longer beside tests
def test_site(tmp_path: Path, subtests: pytest.Subtests) -> None:
    """The strict build passes; notebook pages and the API page hold what they should."""
    site = tmp_path / "site"
    _build(site)
    links = 0
    for name in NOTEBOOKS:
        page = site / "tutorials" / name / "index.html"
        notebook = ROOT / "notebooks" / f"{name}.ipynb"
        with subtests.test("plots", notebook=name):
            _assert_plots_shown(page)
        with subtests.test("every cell ran", notebook=name):
            _assert_every_cell_ran(page, notebook)
        with subtests.test("links", notebook=name):
            links += _assert_links_lead_to_pages(site, page, notebook)
    assert links >= 5
    with subtests.test("API reference"):
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
