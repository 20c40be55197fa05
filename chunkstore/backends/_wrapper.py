"""A store in front of another: the base for cross-cutting behaviour as a wrapper.

:class:`WrapperStore` forwards every operation and capability to the store it wraps.
A subclass overrides only what it changes, such as compression on the way in and out.
It stays a complete :class:`Store`.
The model is zarr's ``WrapperStore``.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from typing import Any

from chunkstore.backends.base import Buffer, ChunkInfo, Store
from chunkstore.hashing import ChunkKey

__all__ = ["WrapperStore"]


class WrapperStore(Store):
    """Forwards everything to ``inner``, under the inner store's name and kind.

    Reads go through the inner store's validated :meth:`~Store.get_many`.
    The inner store verifies and quarantines.
    The wrapper does not decode chunks a second time.
    So the wrapper's :attr:`verify` is the inner store's.
    Closing the wrapper closes the inner store.
    """

    def __init__(self, inner: Store, *, name: str | None = None) -> None:
        self.inner = inner
        """The wrapped store."""
        super().__init__(name=name or inner.name, verify=inner.verify)
        self.kind = inner.kind

    @property
    def verify(self) -> bool:
        """Whether every chunk read through this wrapper was checked.
        It is the inner store's setting, and setting it sets the inner store's.
        A caller deciding whether to checksum what it got a second time reads this.
        The vLLM native tier is such a caller."""
        return self.inner.verify

    @verify.setter
    def verify(self, value: bool) -> None:
        self.inner.verify = value

    def _checked(self, key: ChunkKey, data: Any) -> Any:
        return data  # the inner store's get_many judged it and acted on the verdict

    @property
    def unsupported_grace(self) -> float | None:
        """The inner store's (it is the one whose put-if-absent replaces)."""
        return self.inner.unsupported_grace

    @unsupported_grace.setter
    def unsupported_grace(self, value: float | None) -> None:
        self.inner.unsupported_grace = value

    @property
    def supports_listing(self) -> bool:
        return self.inner.supports_listing

    @property
    def atomic_put(self) -> bool:
        return self.inner.atomic_put

    @property
    def high_latency(self) -> bool:
        return self.inner.high_latency

    @property
    def corrupt_detected(self) -> int:
        return self.inner.corrupt_detected

    def report_corrupt(self, key: ChunkKey, exc: Exception) -> None:
        """The inner store counts and sets aside what it holds (a caller that checks what
        it read reports to the store it was given: this wrapper)."""
        self.inner.report_corrupt(key, exc)

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        return self.inner.get_many(keys)

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> builtins.list[bytes | None]:
        return self.inner.read_unchecked_many(keys)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.inner.exists_many(keys)

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        return self.inner.lookup_prefix(keys)

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self.inner.put_many(items)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self.inner.put_if_absent_many(items)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        return self.inner.delete_many(keys)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        return self.inner.list(namespace)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
