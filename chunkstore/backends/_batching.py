"""Batched writes and reads with the results a loop of single calls would give.

Some stores run a batch's writes concurrently, in a thread pool or as concurrent requests.
They cannot let two writes of the same key race.
Which one lands, and which ``put_if_absent`` wins, would then depend on timing.
A loop of single calls settles it by order, and so does this module.
Each key is written once, by the copy a loop would have left in place.
Reads likewise: each key is read once.
So a corrupt chunk asked for twice is found, counted and quarantined once.
A loop would find it once and then miss the file it set aside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from chunkstore.errors import ConfigError
from chunkstore.hashing import ChunkKey

T = TypeVar("T")


def write_once_per_key(
    items: Sequence[tuple[ChunkKey, T]],
    write: Callable[[list[tuple[ChunkKey, T]]], list[bool]],
    *,
    replace: bool,
) -> list[bool]:
    """``write`` the items of distinct keys. Returns True or False per item of ``items``.

    When replacing, a key given twice is written by its last copy.
    The earlier ones count as written: a loop would have written, then overwritten them.
    For put-if-absent it is written by its first copy. The later ones find it there.
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


def first_copies(keys: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
    """Per distinct key, the index of its first copy in ``keys``."""
    first: dict[ChunkKey, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    return first


def read_once_per_key(
    keys: Sequence[ChunkKey],
    buffers: Sequence[Any],
    read: Callable[[list[ChunkKey], list[Any]], list[Any]],
) -> list[Any]:
    """``read`` each distinct key once, into the buffer of its first copy.

    Returns per item of ``keys`` what ``read`` gives: a size, ``None`` or an exception.
    A later copy of a key gets the first copy's bytes in its own buffer.
    It gets ``None`` when the first found nothing.
    Its result is a :class:`ConfigError` when its buffer is read-only or too small.
    A read into it would have raised that.
    """
    first = first_copies(keys)
    if len(first) == len(keys):
        return read(list(keys), list(buffers))
    runs = list(first.values())
    got = dict(zip(runs, read([keys[i] for i in runs], [buffers[i] for i in runs])))
    out: list[Any] = []
    for i, key in enumerate(keys):
        j = first[key]
        result = got[j]
        if i != j and isinstance(result, int):
            result = _copy_chunk(buffers[j], buffers[i], result)
        elif i != j and result is not None:
            result = None  # the first copy's error is raised (in order) for the batch
        out.append(result)
    return out


def _copy_chunk(source: Any, target: Any, size: int) -> int | ConfigError:
    """``size`` bytes of ``source`` into ``target``; ``size``, or the error a read into
    ``target`` would have raised."""
    try:
        view = writable_view(target)
    except ConfigError as exc:
        return exc
    if len(view) < size:
        return buffer_too_small(len(view), size)
    view[:size] = memoryview(source).cast("B")[:size]
    return size


def writable_view(buffer: Any) -> memoryview:
    """``buffer`` as a flat writable byte view; ConfigError if it is read-only."""
    view = memoryview(buffer)
    if view.readonly:
        raise ConfigError("get_into needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def buffer_too_small(room: int, size: int) -> ConfigError:
    """The caller's mistake of a ``room``-byte buffer for a ``size``-byte chunk."""
    return ConfigError(f"buffer of {room} bytes is smaller than the chunk ({size})")
