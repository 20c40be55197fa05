"""MkDocs hooks: render Markdown that reads right on GitHub the same way in the site.

* Docstrings cross-reference with Sphinx roles (``:class:`~chunkstore.hashing.ChunkKey```), which
  mkdocstrings leaves as literal text (``:class:<code>~chunkstore.hashing.ChunkKey</code>``). The
  site shows them as code, with the ``~`` short form reduced to its last name as Sphinx would.
* A table cell's code span writes a pipe as ``\\|`` (GitHub's rule); Python-Markdown keeps the
  backslash inside code, so the site drops it there.

Configured under ``hooks:`` in mkdocs.yml.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")
TABLE_CELL = re.compile(r"<td[^>]*>.*?</td>", re.S)


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def _unescape_pipes(match: re.Match[str]) -> str:
    return match.group(0).replace("\\|", "|")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite Sphinx roles as code and unescape pipes in table cells of a rendered page."""
    return TABLE_CELL.sub(_unescape_pipes, ROLE.sub(_code, html))
