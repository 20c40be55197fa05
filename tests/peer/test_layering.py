"""The package layers point down: nothing in backends/ or cache/ imports the peer package."""

from __future__ import annotations

import ast
from pathlib import Path

import chunkstore

PACKAGE = Path(chunkstore.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports (absolute names; relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_backends_and_cache_do_not_import_peer() -> None:
    sources = sorted((PACKAGE / "backends").rglob("*.py")) + sorted(
        (PACKAGE / "cache").rglob("*.py")
    )
    assert sources
    upward = {
        str(path.relative_to(PACKAGE)): sorted(
            m
            for m in imported_modules(path)
            if m == "chunkstore.peer" or m.startswith("chunkstore.peer.")
        )
        for path in sources
    }
    assert {path: names for path, names in upward.items() if names} == {}


def test_the_store_registry_names_the_peer_store_lazily() -> None:
    text = (PACKAGE / "backends" / "_registry.py").read_text()
    assert '"chunkstore.peer._store"' in text
    assert "chunkstore.peer" not in " ".join(
        imported_modules(PACKAGE / "backends" / "_registry.py")
    )
