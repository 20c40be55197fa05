"""MkDocs hooks: render Markdown that reads right on GitHub the same way in the site.

* List items: GitHub nests a block (a code fence, a second paragraph, a sub-list) under a list
  item when it is indented to the item's text (3 spaces after ``1.``, 2 after ``-``);
  Python-Markdown wants 4, and otherwise ends the list there. The site indents such blocks to 4
  before rendering (after README and spec sections are included), so ``spec/PROTOCOL.md`` keeps
  its numbered rules in one list.
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

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")
TABLE_CELL = re.compile(r"<td[^>]*>.*?</td>", re.S)
LIST_ITEM = re.compile(r"(?:[-*+]|\d+\.) +")
FENCE = re.compile(r"(```|~~~)")
PYTHON_MARKDOWN_INDENT = 4
# After pymdownx.snippets (32) has included README and spec sections, before fenced code (25).
AFTER_SNIPPETS = 31.5


def github_list_indents(lines: list[str]) -> list[str]:
    """Indent blocks nested under top-level list items from the item's text column to 4."""
    out: list[str] = []
    shift = 0  # spaces to add to lines nested in the current top-level item
    nested_block = False  # the current item holds a block after a blank line
    in_fence = False  # inside a fence that starts at column 0 (never part of a list)
    for line in lines:
        previous = out[-1] if out else ""
        if not line.startswith(" ") and FENCE.match(line):
            in_fence, shift = not in_fence, 0
        elif in_fence:
            pass
        elif item := LIST_ITEM.match(line):
            # GitHub starts the next item right after a nested block; Python-Markdown would read
            # it as that block's last line unless a blank line separates them.
            if nested_block and previous.strip():
                out.append("")
            shift = max(0, PYTHON_MARKDOWN_INDENT - item.end())
            nested_block = False
        elif line.strip() and not line.startswith(" "):
            shift, nested_block = 0, False
        elif shift and line.strip():
            nested_block = nested_block or not previous.strip()
            line = " " * shift + line
        out.append(line)
    return out


class _GithubListIndents(Preprocessor):  # type: ignore[misc]  # markdown has no type hints
    def run(self, lines: list[str]) -> list[str]:
        return github_list_indents(lines)


class _GithubListIndentsExtension(Extension):  # type: ignore[misc]  # (as above)
    def extendMarkdown(self, md: Markdown) -> None:  # noqa: N802 (Python-Markdown's name)
        md.preprocessors.register(_GithubListIndents(md), "github_list_indents", AFTER_SNIPPETS)


def on_config(config: Any, **kwargs: Any) -> Any:
    """Add the list-indent preprocessor to every page's Markdown."""
    config.markdown_extensions.append(_GithubListIndentsExtension())
    return config


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def _unescape_pipes(match: re.Match[str]) -> str:
    return match.group(0).replace("\\|", "|")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite Sphinx roles as code and unescape pipes in table cells of a rendered page."""
    return TABLE_CELL.sub(_unescape_pipes, ROLE.sub(_code, html))
