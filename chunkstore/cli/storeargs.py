"""Options every store-reading command shares, and opening a store from them.

``--config FILE`` (JSON/YAML) and ``-o KEY=VALUE`` pass store options (an S3
endpoint, credentials profile, ``verify``...) to :func:`chunkstore.open_store`.
Read-only commands open with ``create=False`` semantics: a mistyped local path
is an error, never a new empty directory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ConfigError, StoreError
from chunkstore.units import parse_size

if TYPE_CHECKING:
    from chunkstore.backends.base import Store


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--quiet``, which every command has."""
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead of tables"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")


def add_maintenance_options(
    parser: argparse.ArgumentParser, *, batch_default: int, batch_unit: str
) -> None:
    """``--grace AGE`` (orphan temp files) and ``--batch N``, shared by ``verify`` and ``prune``."""
    from chunkstore.cli.orphans import DEFAULT_GRACE

    parser.add_argument(
        "--grace",
        metavar="AGE",
        default=DEFAULT_GRACE,
        help=f"remove orphan temp files older than this (default {DEFAULT_GRACE})",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=batch_default,
        metavar="N",
        help=f"chunks {batch_unit} per request (default {batch_default})",
    )


def add_store_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    prefix: str = "",
    who: str | None = None,
) -> None:
    """``--config FILE`` and repeatable ``-o KEY=VALUE`` (with ``prefix``: ``--src-config``...);
    ``who`` names the stores they are for in the help."""
    dashed = f"--{prefix}-" if prefix else "--"
    dest = f"{prefix}_" if prefix else ""
    if who is None:
        who = f"the {prefix.upper()} store" if prefix else "the store"
    parser.add_argument(
        f"{dashed}config",
        dest=f"{dest}config",
        metavar="FILE",
        help=f"JSON or YAML file of options for {who}",
    )
    names = [f"{dashed}option"] if prefix else ["-o", "--option"]
    parser.add_argument(
        *names,
        dest=f"{dest}option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help=f"an option for {who} (repeatable; VALUE is JSON if it parses, else a string)",
    )


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``; raises :class:`ConfigError`."""
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"store option {pair!r} must look like KEY=VALUE")
        try:
            options[name.strip()] = json.loads(value)
        except ValueError:
            options[name.strip()] = value
    return options


def size_arg(text: str) -> int:
    """argparse ``type=`` for a size option (``8G``, ``512MiB``): bounded, one-line errors."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def namespace_arg(text: str) -> str:
    """argparse ``type=`` for ``--namespace``: 16 lower-case hex digits."""
    from chunkstore.hashing import check_namespace

    try:
        return check_namespace(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def local_path(url: str) -> Path | None:
    """The directory a bare path or ``file://`` URL names; ``None`` for other schemes."""
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    if "://" in url:
        return None
    return Path(url)


def _takes_create(url: str) -> bool:
    """Whether the store behind ``url`` has a ``create`` option: S3 and fsspec filesystems."""
    scheme = url.split("://", 1)[0].lower()
    if scheme == "s3":
        return True
    try:
        from fsspec.registry import known_implementations
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        return False
    return scheme in known_implementations and scheme != "memory"


def check_local_store(path: Path) -> None:
    """One clear error for a local store directory that is missing, a file, or unreadable."""
    if not path.exists():
        raise StoreError(f"no such store directory: {path}")
    if not path.is_dir():
        raise StoreError(f"not a store directory (it is a file): {path}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise StoreError(f"cannot read store directory {path}: permission denied")


def open_cli_store(
    url: str,
    args: argparse.Namespace,
    *,
    prefix: str = "",
    create: bool = False,
    option: str | None = None,
) -> Store:
    """Open ``url`` with the options given on the command line.

    With ``create=False`` a local directory must already exist and be readable;
    the store itself (``create=False`` option) rejects directories that are not
    chunkstore stores. Every failure is one line naming the URL (and ``option``,
    the flag it came from, when given); an unreachable store is a ``StoreError``
    (exit code 4).
    """
    from chunkstore.backends._registry import check_url, load_options, open_for_option, open_store

    # memory:// is refused: the registry gives each open a fresh MemoryStore, so a CLI run
    # would read an empty store or write into one that vanishes when the command exits.
    if option is None:
        check_url(url, in_process=False)
    dest = f"{prefix}_" if prefix else ""
    options = load_options(getattr(args, f"{dest}config", None))
    options.update(parse_options(getattr(args, f"{dest}option", []) or []))
    path = local_path(url)
    if path is not None and not create:
        check_local_store(path)
    if path is not None or _takes_create(url):
        options.setdefault("create", create)
    if option is not None:
        return open_for_option(option, url, **options)
    return open_store(url, **options)
