"""The package layers point down: format, hashing, backends, cache, tiering, peer, node, vllm, cli.

Every import of one of chunkstore's own modules is checked, deferred ones (inside a
function, under ``TYPE_CHECKING``) included: a lazy import still makes the lower layer
depend on the higher one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import chunkstore

PACKAGE = Path(chunkstore.__file__).parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "units": 1,
    "metrics": 1,
    "_version": 1,
    "_hugepages": 1,
    "_threads": 1,
    "_lazy": 0,
    "format": 2,
    "hashing": 3,
    "events": 4,
    "backends": 4,
    "testing": 5,
    "cache": 6,
    "tiering": 7,
    "device": 7,
    "simulator": 7,
    "peer": 8,
    "node": 9,
    "vllm": 10,
    "demo": 10,
    "cli": 11,
}
"""Each top-level part of chunkstore and its layer: a part imports only parts of lower
layers (``testing``, the store suite and chunk factories, sits on ``backends``; ``node``
on ``peer``, whose client and protocol it speaks; the demos and the simulator beside the
layer they drive; ``device``, the torch copies an engine adapter makes, beside the
tiering layer). Parts of one layer do not import each other."""


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


def part_of(module: str) -> str | None:
    """The top-level part of chunkstore a module name is in (``None``: not chunkstore's, or
    the package itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "chunkstore" and len(parts) > 1 else None


def sources() -> list[Path]:
    """Every source file of chunkstore but the top-level ``__init__`` (the curated facade,
    which imports its lower layers lazily)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in sources()}
    assert {"format", "hashing", "backends", "cache", "tiering", "device", "peer", "node"} <= parts
    assert {"vllm", "cli"} <= parts
    assert parts - set(LAYERS) == set()


def test_imports_point_down_the_layers() -> None:
    upward: dict[str, list[str]] = {}
    for path in sources():
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        wrong = sorted(
            module
            for module in imported_modules(path)
            if (other := part_of(module)) is not None
            and other != own
            and other in LAYERS  # a name imported from chunkstore itself, e.g. ``__version__``
            and LAYERS[other] >= LAYERS[own]
        )
        if wrong:
            upward[str(path.relative_to(PACKAGE))] = wrong
    assert upward == {}


def test_tp_shard_assembly_and_the_store_wrappers_have_one_home_each() -> None:
    """TP shard assembly (the ranks' side, the owner's, the node service's) is one package
    of the cache layer; a wrapper store (cross-cutting behaviour, such as compression) is
    a store in ``backends``, not part of an engine adapter."""

    def homes(pattern: str) -> set[str]:
        return {
            str(path.parent.relative_to(PACKAGE))
            for path in sources()
            if re.search(pattern, path.read_text(), re.MULTILINE)
        }

    assert homes(r"^class \w*Assembl") == {"cache/assembly"}
    assert homes(r"^class \w+\(WrapperStore\)") == {"backends"}


def test_the_rest_of_the_cache_does_not_import_its_assembly_package() -> None:
    """TP shard assembly sits on the host cache and the pool; only the
    cache package's ``__init__`` re-exports from it."""
    cache = PACKAGE / "cache"
    below = [p for p in sorted(cache.glob("*.py")) if p.name != "__init__.py"]
    assert below
    assert {
        p.name: sorted(m for m in imported_modules(p) if m.startswith("chunkstore.cache.assembly"))
        for p in below
        if any(m.startswith("chunkstore.cache.assembly") for m in imported_modules(p))
    } == {}


def test_the_store_registry_names_the_peer_store_lazily() -> None:
    text = (PACKAGE / "backends" / "_registry.py").read_text()
    assert '"chunkstore.peer._store"' in text
    assert "chunkstore.peer" not in " ".join(
        imported_modules(PACKAGE / "backends" / "_registry.py")
    )
