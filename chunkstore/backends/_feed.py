"""A shared store's change feed: the chunks its capacity index took in and out, as they go.

The index's scripts append one entry to a Redis stream for each chunk they put into the LRU
order (``s``: stored) or take out of the index (``r``: removed); see
:mod:`chunkstore.backends._index_scripts`. A writer's stored entry also carries ``d``: the
chunk's parent digest and token bytes, so a reader can announce it without reading its
header. Every writer of the store, on every machine,
goes through them, so one reader of the stream sees the whole store change within a round
trip, where a listing would see it at its next walk.

The stream is a hint, like the index. It keeps about
:data:`~chunkstore.backends._index_scripts.FEED_LENGTH` entries, and a server restart or a
flush loses it. :meth:`ChangeFeed.read` says when entries were lost since the last read (a
gap): the reader then lists the store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from chunkstore.errors import KeyParseError
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

READ_COUNT = 1000
"""Most entries one read returns."""
MAX_WAIT = 1.0
"""Longest one read waits for an entry: under the index's socket timeout."""


@dataclass(slots=True)
class FeedRead:
    """What one :meth:`ChangeFeed.read` found."""

    stored: list[ChunkKey] = field(default_factory=list)
    """Chunks put into the index, in order (a key may also be in ``removed``, later)."""
    changes: list[tuple[bool, ChunkKey]] = field(default_factory=list)
    """Every change in the order it happened: ``(True, key)`` stored, ``(False, key)``
    removed."""
    links: dict[ChunkKey, bytes] = field(default_factory=dict)
    """For stored chunks whose entry carried it (``d``): the parent digest and token bytes
    the writer read from the chunk's header. Unchecked: BLAKE3 of it is the key's digest
    when it is honest."""
    gap: bool = False
    """Entries were lost since the last read: list the store to know what it holds."""


def _id(raw: Any) -> tuple[int, int]:
    """A stream entry ID, ``b"<ms>-<seq>"``, as a pair that orders like the ID."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class ChangeFeed:
    """Reads one store's change feed, from when it was opened on (``from_start``: from
    the oldest entry it still holds).

    ``client`` is a Redis client; ``key`` the stream (``chunkstore:{<id>}:feed``). Reads
    block at most their ``timeout``. A server that is down reads as a gap once it answers
    again: what changed meanwhile is unknown.
    """

    def __init__(
        self, client: Any, key: str, label: str = "store", *, from_start: bool = False
    ) -> None:
        self.client = client
        self.key = key
        self._label = label
        self._position = (0, 0)  # the last entry read (or the stream's end when opened)
        self._count = 0  # entries the stream had taken in up to the position
        self._lost = False  # a read failed: the next one that works reports a gap
        self.errors = 0
        """Reads that failed (the server down or unreachable)."""
        if from_start:
            return
        import redis

        try:
            state = self._state()
        except (redis.RedisError, OSError) as exc:  # down: the first read that works is a gap
            self._lost = True
            self.errors += 1
            log.warning("%s: change feed unreachable (%s); listing instead", self._label, exc)
            return
        if state is not None:
            self._position, self._count = state.last, state.added or 0

    def _state(self) -> _Stream | None:
        """What the stream is now; None: no stream (nothing written since it began)."""
        import redis

        try:
            info = self.client.xinfo_stream(self.key)
        except redis.ResponseError:  # no such key
            return None
        first = info.get("first-entry")
        added = info.get("entries-added")  # Redis 7 and Valkey; None before
        return _Stream(
            _id(info.get("last-generated-id", b"0-0")),
            _id(first[0]) if first else None,
            int(info.get("length", 0)),
            None if added is None else int(added),
        )

    def read(self, timeout: float) -> FeedRead:
        """The changes since the last read, waiting up to ``timeout`` seconds for one.

        At most :data:`READ_COUNT` entries a call, waiting at most :data:`MAX_WAIT`
        seconds. When the stream lost entries since the last read, ``gap`` is set and
        reading goes on from the stream's end. Entries are lost when they were trimmed
        before they were read, when the stream went (a flush, a server restarted with no
        persistence) or began anew, and when a read failed."""
        import redis

        before = self._position
        out = FeedRead()
        try:
            answer = self.client.xread(
                {self.key: f"{before[0]}-{before[1]}"},
                count=READ_COUNT,
                block=max(1, int(min(timeout, MAX_WAIT) * 1000)),
            )
            state = self._state()
        except (redis.RedisError, OSError) as exc:
            if not self._lost:
                log.warning("%s: change feed unreachable (%s); listing instead", self._label, exc)
            self._lost = True
            self.errors += 1
            return out
        entries = answer[0][1] if answer else []
        for raw_id, fields in entries:
            self._position = _id(raw_id)
            self._count += 1
            fields = {_text(kind): value for kind, value in fields.items()}
            for kind, stored in (("s", True), ("r", False)):
                name = fields.get(kind)
                key = None if name is None else _key_of_name(name)
                if key is None:
                    continue
                out.changes.append((stored, key))
                if stored:
                    out.stored.append(key)
                    link = fields.get("d")
                    if isinstance(link, bytes):
                        out.links[key] = link
        out.gap = self._lost
        self._lost = False
        if state is None:
            out.gap = out.gap or before != (0, 0)
            self._position, self._count = (0, 0), 0
        elif out.gap or state.lost_since(before, self._count):
            out.gap = True
            self._position, self._count = state.last, state.added or 0
        return out


@dataclass(frozen=True, slots=True)
class _Stream:
    """The parts of ``XINFO STREAM`` a reader checks its position against."""

    last: tuple[int, int]
    """The last ID the stream gave out."""
    first: tuple[int, int] | None
    """Its oldest entry's ID (None: empty)."""
    length: int
    """Entries it holds."""
    added: int | None
    """Entries it ever took in (None: a server older than Redis 7)."""

    def lost_since(self, position: tuple[int, int], count: int) -> bool:
        """Whether entries after ``position`` (``count`` taken in up to it) are gone.

        Unread entries outnumber those held: trimmed. Fewer ever taken in than up to the
        position: the stream began anew. Its oldest entry past the position: trimmed up
        to past it, or begun anew since (then a gap may be reported where only entries
        already read were trimmed: the reader lists once more, nothing is missed)."""
        if self.added is not None and (self.added < count or self.added - count > self.length):
            return True
        return position != (0, 0) and self.first is not None and self.first > position


def _key_of_name(name: Any) -> ChunkKey | None:
    """The key of a chunk name ``<ns>/<ab>/<cd>/<hex>.kvc``; None for anything else."""
    try:
        return ChunkKey.parse_path(_text(name))
    except (KeyParseError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
