"""Human tables and the progress bar (drawn only on a terminal, never with --quiet)."""

from __future__ import annotations

import io

from chunkstore.cli.progress import Progress
from chunkstore.cli.table import render_fields, render_table


def test_table_aligns_and_right_aligns_numbers() -> None:
    text = render_table(["name", "count"], [["alpha", 5], ["b", 12345]])
    assert text.splitlines() == [
        "NAME   COUNT",
        "alpha      5",
        "b      12345",
    ]


def test_table_explicit_right_columns_and_empty() -> None:
    text = render_table(["a", "size"], [["x", "1 KiB"], ["yy", "10 MiB"]], right=[1])
    assert text.splitlines() == ["A     SIZE", "x    1 KiB", "yy  10 MiB"]
    assert render_table(["a", "b"], []) == "A  B"


def test_fields() -> None:
    assert render_fields([("key", "ab"), ("namespace", 1)]) == "key:       ab\nnamespace: 1"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_tty_and_erases_itself() -> None:
    stream = _Tty()
    with Progress("verify", 4, stream=stream) as bar:
        for _ in range(4):
            bar.advance()
    text = stream.getvalue()
    assert "verify [" in text and "4/4" in text and "100%" in text and "chunks/s" in text
    assert text.endswith("\r")  # the final erase leaves the cursor at column 0


def test_progress_silent_when_not_a_tty_or_quiet() -> None:
    plain = io.StringIO()
    with Progress("verify", 3, stream=plain) as bar:
        bar.advance(3)
    quiet = _Tty()
    with Progress("verify", 3, stream=quiet, quiet=True) as bar:
        bar.advance(3)
    assert plain.getvalue() == "" and quiet.getvalue() == ""
    assert bar.done == 3
