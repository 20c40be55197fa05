"""Batched writes with the results a loop of single writes would give.

Stores that run a batch's writes concurrently (a thread pool, concurrent
requests) cannot let two writes of the same key race: which one lands, and
which ``put_if_absent`` wins, would then depend on timing. A loop of single
calls settles it by order, and so does this: each key is written once, by the
copy a loop would have left in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from chunkstore.hashing import ChunkKey

T = TypeVar("T")


def write_once_per_key(
    items: Sequence[tuple[ChunkKey, T]],
    write: Callable[[list[tuple[ChunkKey, T]]], list[bool]],
    *,
    replace: bool,
) -> list[bool]:
    """``write`` the items of distinct keys; True/False per item of ``items``.

    When replacing, a key given twice is written by its last copy (the earlier
    ones count as written: a loop would have written and then overwritten
    them); for put-if-absent, by its first copy (the later ones find it there).
    """
    chosen: dict[ChunkKey, int] = {}
    for i, (key, _) in enumerate(items):
        if replace or key not in chosen:
            chosen[key] = i
    if len(chosen) == len(items):
        return write(list(items))
    runs = sorted(chosen.values())
    written = dict(zip(runs, write([items[i] for i in runs])))
    return [written.get(i, replace) for i in range(len(items))]
