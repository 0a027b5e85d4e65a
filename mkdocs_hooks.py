"""mkdocs hooks (mkdocs.yml's ``hooks:``).

The notebooks link to the docs as seen from notebooks/ (``../docs/guide.md``), which is
right on GitHub and in Jupyter. On the site a notebook is a page under tutorials/, and
mkdocs checks and rewrites links in Markdown only, not in a notebook's HTML: this hook
points them at the pages, and fails a strict build on a link to no page.
"""

from __future__ import annotations

import logging
import posixpath
import re
from typing import Any

from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.notebook_links")
_RELATIVE_MD = re.compile(r'href="(?![a-z][a-z0-9+.-]*:|[#/])([^"#]+\.md)(#[^"]*)?"')


def on_page_content(html: str, page: Page, config: Any, files: Files) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return html

    def resolve(match: re.Match[str]) -> str:
        path = posixpath.normpath(posixpath.join("notebooks", match.group(1)))
        target = files.get_file_from_path(path.removeprefix("docs/"))
        if not path.startswith("docs/") or target is None:
            log.warning(f"{page.file.src_uri} links to {match.group(1)}, which is no page")
            return match.group(0)
        return f'href="{target.url_relative_to(page.file)}{match.group(2) or ""}"'

    return _RELATIVE_MD.sub(resolve, html)
