"""MkDocs hook: render the Sphinx roles in chunkstore's docstrings as plain code in the site.

Docstrings cross-reference with Sphinx roles (``:class:`~chunkstore.hashing.ChunkKey```), which
mkdocstrings leaves as literal text (``:class:<code>~chunkstore.hashing.ChunkKey</code>``). The
site shows them as code, with the ``~`` short form reduced to its last name as Sphinx would.
Configured under ``hooks:`` in mkdocs.yml.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """Turn every ``:role:<code>target</code>`` of a rendered page into ``<code>target</code>``."""
    return ROLE.sub(_code, html)
