"""Plain-text tables for human output: aligned columns, numbers right-aligned, no borders."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    right: Sequence[int] | None = None,
) -> str:
    """The table as text, one line per row under an upper-case header line.

    ``right`` lists the columns to right-align; by default every column whose
    cells are all ints or floats is right-aligned. Cells are ``str()``-ed.
    """
    cells = [[str(c) for c in row] for row in rows]
    if right is None:
        right = [
            i
            for i in range(len(headers))
            if rows
            and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
        ]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    right_set = set(right)

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(widths[i]) if i in right_set else v.ljust(widths[i])
            for i, v in enumerate(values)
        ]
        return "  ".join(parts).rstrip()

    out = [line([h.upper() for h in headers])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def render_fields(pairs: Sequence[tuple[str, object]]) -> str:
    """``name: value`` lines with the values aligned (for one record, e.g. a chunk header)."""
    if not pairs:
        return ""
    width = max(len(name) for name, _ in pairs) + 1
    return "\n".join(f"{(name + ':').ljust(width)} {value}" for name, value in pairs)
