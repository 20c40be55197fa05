"""The docs site's MkDocs hooks (tools/docs_hooks.py) render GitHub Markdown as GitHub does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

pytest.importorskip("markdown", reason="pip install 'chunkstore[docs]'")
import markdown  # noqa: E402 (only with the docs extra)

HOOKS = Path(__file__).resolve().parents[1] / "tools" / "docs_hooks.py"

# GitHub nests the fence and the second paragraph under item 1 (indented to the item's text) and
# starts item 2 right after it; spec/PROTOCOL.md is written this way.
GITHUB_LIST = """\
1. A message has frames:

   ```
   message = body || tag
   ```

   The identity frame is not part of it.
2. msgpack only.

Between the lists.

- a bullet

  with a second paragraph
"""


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocks_nested_in_list_items_are_indented_to_four(hooks: ModuleType) -> None:
    lines = hooks.github_list_indents(GITHUB_LIST.splitlines())
    assert lines == [
        "1. A message has frames:",
        "",
        "    ```",
        "    message = body || tag",
        "    ```",
        "",
        "    The identity frame is not part of it.",
        "",
        "2. msgpack only.",
        "",
        "Between the lists.",
        "",
        "- a bullet",
        "",
        "    with a second paragraph",
    ]


def test_top_level_fences_and_text_are_left_alone(hooks: ModuleType) -> None:
    text = ["intro", "```", "  1. cold: computed", "   nested?", "```", "  indented prose"]
    assert hooks.github_list_indents(text) == text


def test_the_site_renders_a_github_list_as_one_list(hooks: ModuleType) -> None:
    config = SimpleNamespace(markdown_extensions=["fenced_code"])
    hooks.on_config(config)
    html = markdown.markdown(GITHUB_LIST, extensions=config.markdown_extensions)
    assert html.count("<ol>") == 1
    assert html.count("<li>") == 3  # two numbered, one bullet
    ordered = html[html.index("<ol>") : html.index("</ol>")]
    assert "<code>message = body || tag" in ordered
    assert "The identity frame is not part of it." in ordered
    assert "with a second paragraph" in html[html.index("<ul>") :]


def test_sphinx_roles_and_escaped_table_pipes_render_as_code(hooks: ModuleType) -> None:
    page = (
        "<p>see :class:<code>~chunkstore.hashing.ChunkKey</code> and "
        ":meth:<code>Store.get_many</code></p>"
        "<table><tr><td><code>verify [--quarantine\\|--delete]</code></td></tr></table>"
        "<pre><code>grep -E 'a\\|b'</code></pre>"
    )
    assert hooks.on_page_content(page) == (
        "<p>see <code>ChunkKey</code> and <code>Store.get_many</code></p>"
        "<table><tr><td><code>verify [--quarantine|--delete]</code></td></tr></table>"
        "<pre><code>grep -E 'a\\|b'</code></pre>"
    )
