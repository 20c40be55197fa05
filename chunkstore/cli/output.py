"""Writing results: one JSON document (``--json``) or text on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(document: Any) -> None:
    """Print ``document`` as JSON on stdout: indented on a terminal, one line otherwise.

    One line for pipes is not only compact: ``json`` uses its C encoder only
    without indentation, which matters for listings of 100k chunks.
    """
    indent = 2 if _is_tty(sys.stdout) else None
    sys.stdout.write(json.dumps(document, indent=indent) + "\n")


def emit_text(text: str) -> None:
    """Print text on stdout, with exactly one trailing newline."""
    sys.stdout.write(text.rstrip("\n") + "\n")


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
