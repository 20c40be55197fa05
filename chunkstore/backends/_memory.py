"""An in-process dict store: the reference implementation and a test double."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from chunkstore.backends.base import UNSUPPORTED_GRACE, Buffer, ChunkInfo, Judgement, Store
from chunkstore.hashing import ChunkKey, check_namespace


class MemoryStore(Store):
    """Chunks in a dict, guarded by one lock. Lost when the process ends."""

    kind = "memory"
    unsupported_grace: float | None = UNSUPPORTED_GRACE

    def __init__(
        self, *, name: str | None = None, verify: bool = True, create: bool = True
    ) -> None:
        # `create` is accepted for symmetry with directory stores: a memory store always
        # starts empty.
        super().__init__(name=name, verify=verify)
        self._data: dict[ChunkKey, tuple[bytes, float, float]] = {}
        self._records: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        with self._lock:
            out = [None if (entry := self._data.get(k)) is None else entry[0] for k in keys]
        if not self.verify:  # nothing is judged: every read is a use
            for key, data in zip(keys, out):
                if data is not None:
                    self._touch(key)
        return out

    def _admit(self, key: ChunkKey, judgement: Judgement) -> bool:
        # A read is a use only if it served the chunk: one this store cannot use ages out.
        served = super()._admit(key, judgement)
        if served:
            self._touch(key)
        return served

    def _touch(self, key: ChunkKey) -> None:
        with self._lock:
            entry = self._data.get(key)
            if entry is not None:
                self._data[key] = (entry[0], entry[1], time.time())

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Stored bytes per key. This is not a use, so access times stay put.
        Prune relies on their LRU order."""
        with self._lock:
            return [None if (entry := self._data.get(k)) is None else entry[0] for k in keys]

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        now = time.time()
        with self._lock:
            for key, data in items:
                self._data[key] = (bytes(memoryview(data).cast("B")), now, now)
        return [True] * len(items)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        now = time.time()
        written = []
        with self._lock:
            for key, data in items:
                if key in self._data:
                    written.append(False)
                else:
                    self._data[key] = (bytes(memoryview(data).cast("B")), now, now)
                    written.append(True)
        return self._replacing_unusable(items, written)

    def _written_at(self, key: ChunkKey) -> float | None:
        with self._lock:
            entry = self._data.get(key)
        return None if entry is None else entry[1]

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            return sum(self._data.pop(k, None) is not None for k in keys)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        if namespace is not None:
            check_namespace(namespace)  # refused like the stores where it becomes a path
        with self._lock:
            snapshot = list(self._data.items())
        for key, (data, mtime, atime) in snapshot:
            if namespace is None or key.namespace == namespace:
                yield ChunkInfo(key, len(data), mtime, atime)

    def read_model_record(self, fingerprint: bytes) -> bytes | None:
        """The record of the model with ``fingerprint`` (``chunkstore.backends._models``)."""
        with self._lock:
            return self._records.get(fingerprint)

    def write_model_record(self, fingerprint: bytes, record: bytes) -> None:
        """Store the record of the model with ``fingerprint``."""
        with self._lock:
            self._records[fingerprint] = bytes(record)

    def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._records.clear()
