"""The replacement-policy interface shared by the host cache and the trace simulator.

A policy only decides *which keys* are resident in a cache of ``capacity`` entries.
It holds no data and does no I/O.
So the simulator replays traces through exactly the classes the host cache runs.
Keys are any hashable value.
The cache uses :class:`~chunkstore.hashing.ChunkKey`, a trace integer hash ids.

Callers drive a policy with two events:

* :meth:`CachePolicy.hit` when a resident key is read. It becomes more recent.
* :meth:`CachePolicy.admit` when a missing key is brought in.
  At most one resident key is evicted to make room, and returned.

Chain structure: KV chunks are prefix-chained, and a policy may use that.
A chunk is usable only with every chunk before it.
``admit(..., parent=)`` and ``access(key, parent)`` name the key of the chunk before this one.
That is ``None`` for a chain's first chunk, or when unknown.
:meth:`CachePolicy.link` records it later for a resident key.
The host cache learns the parent from the chunk header only once the chunk is written.
Policies with ``follows_chains = False``, ARC and LRU, ignore it.
The host cache then does not read headers for it.

``can_evict`` lets the caller veto victims, such as pinned slots or chunks being written back.
The policy then evicts the next candidate in its own order.
It raises :class:`NoEvictableEntry` when every resident key is vetoed.
Its state is then unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator

from chunkstore.errors import ChunkStoreError, ConfigError

CanEvict = Callable[[Hashable], bool]


def first_evictable(entries: Iterable[Hashable], can_evict: CanEvict | None) -> Hashable | None:
    """The first (oldest) key of ``entries`` that ``can_evict`` accepts (any key without one)."""
    if can_evict is None:
        return next(iter(entries), None)
    for key in entries:
        if can_evict(key):
            return key
    return None


"""Predicate: may this resident key be evicted now?"""


class NoEvictableEntry(ChunkStoreError):
    """The cache is full and every resident key is pinned: nothing can be admitted now."""


class CachePolicy(ABC):
    """Bookkeeping of which keys a fixed-size cache holds. Not thread-safe: callers lock."""

    #: Registry name (``"parc"``, ``"arc"``, ``"lru"``).
    name: str = "policy"
    #: Whether the policy uses chain structure (``parent`` / :meth:`link`).
    follows_chains: bool = False

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"a cache policy needs a capacity of at least 1 entry, got {capacity!r}"
            )
        self.capacity = capacity

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (ghost entries do not count)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Hashable]:
        """Resident keys, next victim first (as far as the policy has an order)."""

    @abstractmethod
    def hit(self, key: Hashable) -> bool:
        """Record a read of ``key``; returns whether it was resident (a miss changes nothing)."""

    @abstractmethod
    def admit(
        self, key: Hashable, can_evict: CanEvict | None = None, *, parent: Hashable | None = None
    ) -> Hashable | None:
        """Make ``key`` resident; returns the evicted key, or ``None`` if nothing was evicted.

        ``key`` must not be resident. ``parent``: the key before it in its chain
        (see the module docstring). Raises :class:`NoEvictableEntry` (state
        unchanged) when the cache is full and ``can_evict`` refuses every key.
        """

    def link(self, key: Hashable, parent: Hashable) -> None:  # noqa: B027 (optional hook)
        """Record that ``parent`` precedes the resident ``key`` in its chain (default: ignored)."""

    @abstractmethod
    def remove(self, key: Hashable) -> bool:
        """Forget a resident key (deleted, not evicted: no ghost entry); True if it was resident."""

    def evict(self, can_evict: CanEvict | None = None) -> Hashable | None:
        """Evict one resident key ahead of any admission, chosen by the policy's own rule.

        Returns the key, or ``None`` when nothing is resident or ``can_evict``
        refuses every key. The host cache calls it to keep free slots ready for
        TP rank processes. Default: the first key of the iteration order, forgotten
        like :meth:`remove`; policies with history (ARC's ghosts) override it.
        """
        for key in self:
            if can_evict is None or can_evict(key):
                self.remove(key)
                return key
        return None

    def access(self, key: Hashable, parent: Hashable | None = None) -> bool:
        """One request as a trace replays it: a hit, or a miss that admits ``key``. Returns hit."""
        if self.hit(key):
            return True
        self.admit(key, parent=parent)
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, resident={len(self)})"


def make_policy(name: str, capacity: int) -> CachePolicy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`) for ``capacity`` entries."""
    from chunkstore.cache._arc import ARCPolicy
    from chunkstore.cache._lru import LRUPolicy
    from chunkstore.cache._prefix_arc import PrefixARCPolicy

    policies: dict[str, type[CachePolicy]] = {
        "parc": PrefixARCPolicy,
        "arc": ARCPolicy,
        "lru": LRUPolicy,
    }
    try:
        cls = policies[name.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(
            f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        ) from None
    return cls(capacity)


POLICY_NAMES = ("parc", "arc", "lru")
"""Names :func:`make_policy` accepts, default first (see README "Host cache policies")."""

DEFAULT_POLICY = POLICY_NAMES[0]
"""The host cache's policy unless configured otherwise."""
