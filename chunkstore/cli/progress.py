"""A one-line progress bar on stderr for long operations (verify, prune, cp of many chunks).

It draws only when stderr is a terminal and ``--quiet`` is not given, so
pipes, logs and ``--json`` consumers see nothing but the result on stdout.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24
_REDRAW_SECONDS = 0.1


class Progress:
    """Counts items done out of ``total`` and redraws at most ten times a second.

    Use as a context manager; the line is erased on exit so the summary that
    follows starts on a clean line.
    """

    def __init__(
        self,
        label: str,
        total: int | None,
        *,
        unit: str = "chunks",
        quiet: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and _is_tty(self._stream)
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._width = 0

    def advance(self, count: int = 1) -> None:
        """Record ``count`` more items done; redraw if enough time has passed."""
        self.done += count
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= _REDRAW_SECONDS or self.done == self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        if self.total:
            fraction = min(self.done / self.total, 1.0)
            filled = int(fraction * _BAR_WIDTH)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            remaining = (self.total - self.done) / rate if rate > 0 else 0.0
            text = (
                f"{self.label} [{bar}] {self.done}/{self.total} {fraction:4.0%} "
                f"{rate:,.0f} {self.unit}/s ETA {remaining:,.0f}s"
            )
        else:
            text = f"{self.label} {self.done} {self.unit} {rate:,.0f} {self.unit}/s"
        pad = max(self._width - len(text), 0)
        self._width = len(text)
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        """Erase the bar (if one was drawn)."""
        if self.enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or exotic streams
        return False
