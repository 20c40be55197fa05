"""The ``chunkstore`` command: argument parsing, subcommand discovery and error handling.

Each subcommand is a module in :mod:`chunkstore.cli.commands` with
``register(subparsers)`` that adds its parser and sets ``func`` to a callable
``(args) -> int``. User mistakes surface as one line on stderr and a non-zero
exit code (see :mod:`chunkstore.cli.exitcodes`), never as a traceback.

A run that names a command builds that command's parser alone; ``--help`` and
anything else build them all. So a command module imports at its top only what its
parser needs; stores, the format, caches, peers and their dependencies (numpy,
ml_dtypes, prometheus_client, pyzmq) are imported where the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

from chunkstore._version import __version__
from chunkstore.cli import commands
from chunkstore.cli.exitcodes import EXIT_CODES_HELP, exit_code_for
from chunkstore.errors import ChunkStoreError


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record.

    A plain StreamHandler keeps the stream it was created with; when ``main`` runs
    inside a host program or a test that swaps ``sys.stderr``, background threads would
    later log into a closed stream.
    """

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def _configure_logging(verbosity: int) -> None:
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)]
    root = logging.getLogger()
    root.setLevel(level)
    handler = next((h for h in root.handlers if isinstance(h, _CurrentStderrHandler)), None)
    if handler is None:
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    # Libraries may set their own loggers' levels (werkzeug sets INFO); records propagate to
    # this handler whatever the root's level, so the handler itself filters.
    handler.setLevel(level)


def _module_named(argv: Sequence[str]) -> str | None:
    """The command module ``argv``'s first word names, if it comes before any other option."""
    for arg in argv:
        if arg in ("-v", "-vv", "-vvv", "--verbose"):
            continue
        if arg.startswith("-"):
            return None
        name = arg.replace("-", "_")
        known = {info.name for info in pkgutil.iter_modules(commands.__path__)}
        return name if name in known else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser, with every subcommand module in ``chunkstore.cli.commands``, or ``only``."""
    parser = argparse.ArgumentParser(
        prog="chunkstore",
        description=(
            "Inspect, verify, prune and copy LLM KV-cache chunk stores; run demos, "
            "benchmarks, the trace simulator and peer servers."
        ),
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"chunkstore {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    if only is None:
        names = sorted(info.name for info in pkgutil.iter_modules(commands.__path__))
    else:
        names = [only]  # a module the caller found among them
    for name in names:
        importlib.import_module(f"{commands.__name__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_module_named(words))
    args = parser.parse_args(words)
    _configure_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("chunkstore: interrupted", file=sys.stderr)
        return 130
    except ChunkStoreError as exc:
        print(f"chunkstore {args.command}: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
