"""Prometheus metrics (``chunkstore_*``) and the ``/metrics`` HTTP server.

Two kinds of metric live here:

* **Instrumented** ones: hits, misses, latencies, bytes, drops, promotions, tier errors.
  The code on the data path increments them.
  It does so through the per-tier :class:`TierInstruments` a :class:`ChunkstoreMetrics`
  hands out.
* **Observed** ones: host cache occupancy, evictions, corrupt chunks, queue depth, tier health.
  A collector reads them from the watched objects at scrape time.
  So the hot path pays nothing for them.

Every tier metric carries a ``tier`` label: the store's ``name``.
The host cache is ``host`` unless renamed.
``direction`` is relative to the tier.
``read`` counts bytes read out of it, ``write`` bytes written into it.

Copies between accelerator and host memory have their own ``chunkstore_device_*`` metrics.
An engine adapter does those copies, not chunkstore.
Their ``direction`` is ``device_to_host`` for saves, or ``host_to_device`` for loads.
An adapter reports each copy with :func:`record_device_transfer`.

The process default: :func:`default_metrics` returns the one :class:`ChunkstoreMetrics`
of this process.
It is registered in prometheus-client's default registry, ``prometheus_client.REGISTRY``.
:func:`start_metrics_server` exposes that registry.
A host application that already serves it shows the metrics without further work.
vLLM's API server does.
Stores use it unless given another.
To keep metrics apart, build a :class:`ChunkstoreMetrics` on a private
:class:`~prometheus_client.CollectorRegistry`, as tests do.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkstore.errors import ConfigError

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Latency buckets in seconds.
They run from a host hit at the low end to a stalled object store at the top."""
THROUGHPUT_BUCKETS = tuple(float(2**e) for e in range(20, 38, 2))
"""Bytes per second: 1 MiB/s to 128 GiB/s in factors of four."""
DIRECTIONS = ("read", "write")
DEVICE_DIRECTIONS = ("device_to_host", "host_to_device")
"""``direction`` values of the ``chunkstore_device_*`` metrics: saves, then loads."""


class _HostLike(Protocol):
    name: str

    def stats(self) -> Any: ...


class _StoreLike(Protocol):
    name: str

    @property
    def corrupt_detected(self) -> int: ...


class _TieredLike(Protocol):
    name: str

    def health(self) -> Any: ...


class TierInstruments:
    """The metric children of one tier, resolved once (label lookups off the hot path)."""

    __slots__ = (
        "_errors",
        "_metrics",
        "hits",
        "lookup_latency",
        "misses",
        "name",
        "promotions",
        "read_bytes",
        "read_latency",
        "read_throughput",
        "write_bytes",
        "write_latency",
        "write_throughput",
    )

    def __init__(self, metrics: ChunkstoreMetrics, name: str) -> None:
        self._metrics = metrics
        self.name = name
        self.hits = metrics.hits.labels(tier=name)
        self.misses = metrics.misses.labels(tier=name)
        self.lookup_latency = metrics.lookup_latency.labels(tier=name)
        self.read_latency = metrics.transfer_latency.labels(tier=name, direction="read")
        self.write_latency = metrics.transfer_latency.labels(tier=name, direction="write")
        self.read_bytes = metrics.transfer_bytes.labels(tier=name, direction="read")
        self.write_bytes = metrics.transfer_bytes.labels(tier=name, direction="write")
        self.read_throughput = metrics.throughput.labels(tier=name, direction="read")
        self.write_throughput = metrics.throughput.labels(tier=name, direction="write")
        self.promotions = metrics.promotions.labels(tier=name)
        self._errors: dict[str, Any] = {}

    def record_read(self, nbytes: int, seconds: float) -> None:
        """One transfer of ``nbytes`` read out of this tier."""
        self.read_latency.observe(seconds)
        self.read_bytes.inc(nbytes)
        if seconds > 0 and nbytes:
            self.read_throughput.observe(nbytes / seconds)

    def record_write(self, nbytes: int, seconds: float) -> None:
        """One transfer of ``nbytes`` written into this tier."""
        self.write_latency.observe(seconds)
        self.write_bytes.inc(nbytes)
        if seconds > 0 and nbytes:
            self.write_throughput.observe(nbytes / seconds)

    def dropped(self, reason: str, count: int = 1) -> None:
        """``count`` chunk writes meant for this tier that were not performed."""
        self._metrics.writes_dropped.labels(tier=self.name, reason=reason).inc(count)

    def error(self, op: str) -> None:
        """One failed or timed-out call of ``op`` on this tier."""
        child = self._errors.get(op)
        if child is None:
            child = self._errors[op] = self._metrics.tier_errors.labels(tier=self.name, op=op)
        child.inc()


class ChunkstoreMetrics:
    """All ``chunkstore_*`` metrics, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        """Where the metrics are registered (what the HTTP server exposes)."""
        r = self.registry
        self.hits = Counter(
            "chunkstore_cache_hits", "Chunk reads served by a tier.", ["tier"], registry=r
        )
        self.misses = Counter(
            "chunkstore_cache_misses", "Chunk reads a tier could not serve.", ["tier"], registry=r
        )
        self.lookup_latency = Histogram(
            "chunkstore_lookup_latency_seconds",
            "Latency of presence lookups (exists, lookup_prefix) per tier.",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_latency = Histogram(
            "chunkstore_transfer_latency_seconds",
            "Latency of chunk transfers per tier and direction "
            "(read: out of the tier, write: into it).",
            ["tier", "direction"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "chunkstore_transfer_bytes",
            "Chunk bytes moved per tier and direction.",
            ["tier", "direction"],
            registry=r,
        )
        self.throughput = Histogram(
            "chunkstore_transfer_throughput_bytes_per_second",
            "Throughput of individual transfers per tier and direction.",
            ["tier", "direction"],
            buckets=THROUGHPUT_BUCKETS,
            registry=r,
        )
        self.writes_dropped = Counter(
            "chunkstore_writes_dropped",
            "Chunk writes to a tier not performed: reason queue_full (backpressure), "
            "tier_down (tier in back-off), tier_error (the write failed or timed out).",
            ["tier", "reason"],
            registry=r,
        )
        self.promotions = Counter(
            "chunkstore_promotions",
            "Chunks copied into host memory after a hit in a lower tier.",
            ["tier"],
            registry=r,
        )
        self.tier_errors = Counter(
            "chunkstore_tier_errors",
            "Failed or timed-out calls to a tier, by operation.",
            ["tier", "op"],
            registry=r,
        )
        self.device_bytes = Counter(
            "chunkstore_device_bytes",
            "Bytes copied between accelerator and host memory, by direction "
            "(device_to_host: saves, host_to_device: loads).",
            ["direction"],
            registry=r,
        )
        self.device_transfers = Counter(
            "chunkstore_device_transfers",
            "Copies between accelerator and host memory.",
            ["direction"],
            registry=r,
        )
        self.device_latency = Histogram(
            "chunkstore_device_transfer_seconds",
            "Duration of copies between accelerator and host memory.",
            ["direction"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.device_throughput = Histogram(
            "chunkstore_device_throughput_bytes_per_second",
            "Throughput of individual copies between accelerator and host memory.",
            ["direction"],
            buckets=THROUGHPUT_BUCKETS,
            registry=r,
        )
        self._collector = _WatchCollector()
        r.register(self._collector)
        self._tiers: dict[str, TierInstruments] = {}
        self._tiers_lock = threading.Lock()

    def tier(self, name: str) -> TierInstruments:
        """The instruments of tier ``name`` (created on first use, then shared)."""
        found = self._tiers.get(name)
        if found is not None:
            return found
        with self._tiers_lock:
            return self._tiers.setdefault(name, TierInstruments(self, name))

    def record_transfer(self, tier: str, direction: str, nbytes: int, seconds: float) -> None:
        """Record one transfer (e.g. ``tier="device"`` for device<->host copies)."""
        if direction not in DIRECTIONS:
            raise ConfigError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        instruments = self.tier(tier)
        if direction == "read":
            instruments.record_read(nbytes, seconds)
        else:
            instruments.record_write(nbytes, seconds)

    def record_device_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """One copy of ``nbytes`` between accelerator and host memory that took ``seconds``.

        ``direction``: ``"device_to_host"`` (a save) or ``"host_to_device"`` (a
        load). Record one call per copy operation (a batch of blocks is one).
        """
        if direction not in DEVICE_DIRECTIONS:
            raise ConfigError(f"direction must be one of {DEVICE_DIRECTIONS}, got {direction!r}")
        if nbytes < 0 or seconds < 0:
            raise ConfigError(f"nbytes and seconds must be >= 0, got {nbytes} and {seconds}")
        self.device_bytes.labels(direction=direction).inc(nbytes)
        self.device_transfers.labels(direction=direction).inc()
        self.device_latency.labels(direction=direction).observe(seconds)
        if seconds > 0 and nbytes:
            self.device_throughput.labels(direction=direction).observe(nbytes / seconds)

    def watch_host(self, cache: _HostLike) -> None:
        """Report a host cache's occupancy and evictions at every scrape (weakly referenced)."""
        self._collector.hosts.add(cache)

    def watch_store(self, store: _StoreLike) -> None:
        """Report a store's ``corrupt_detected`` count at every scrape (weakly referenced)."""
        self._collector.stores.add(store)

    def watch_tiered(self, tiered: _TieredLike) -> None:
        """Report a tiered store's write queue and tier health at every scrape."""
        self._collector.tiered.add(tiered)


class _WatchCollector(Collector):
    """Reads the observed metrics from live objects when Prometheus scrapes."""

    def __init__(self) -> None:
        self.hosts: weakref.WeakSet[Any] = weakref.WeakSet()
        self.stores: weakref.WeakSet[Any] = weakref.WeakSet()
        self.tiered: weakref.WeakSet[Any] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "chunkstore_host_cache_bytes_used",
            "Bytes of chunk data held in the host cache.",
            labels=["tier"],
        )
        capacity = GaugeMetricFamily(
            "chunkstore_host_cache_bytes_capacity", "Host cache capacity in bytes.", labels=["tier"]
        )
        chunks = GaugeMetricFamily(
            "chunkstore_host_cache_chunks", "Chunks resident in the host cache.", labels=["tier"]
        )
        pinned = GaugeMetricFamily(
            "chunkstore_host_cache_pinned_slots",
            "Host cache slots pinned by a reader, writer or pending write-back.",
            labels=["tier"],
        )
        evictions = CounterMetricFamily(
            "chunkstore_evictions",
            "Chunks evicted from the host cache by its policy.",
            labels=["tier"],
        )
        for cache in list(self.hosts):
            stats = cache.stats()
            used.add_metric([cache.name], stats.bytes_used)
            capacity.add_metric([cache.name], stats.capacity_bytes)
            chunks.add_metric([cache.name], stats.chunks)
            pinned.add_metric([cache.name], stats.pinned_slots)
            evictions.add_metric([cache.name], stats.evictions)
        yield from (used, capacity, chunks, pinned, evictions)

        corrupt = CounterMetricFamily(
            "chunkstore_corrupt_chunks",
            "Corrupt chunks detected on read (each a miss, set aside where still there).",
            labels=["tier"],
        )
        totals: dict[str, int] = {}
        for store in list(self.stores):
            totals[store.name] = totals.get(store.name, 0) + store.corrupt_detected
        for name, total in sorted(totals.items()):
            corrupt.add_metric([name], total)
        yield corrupt
        yield from _io_mode_metrics(list(self.stores))

        depth = GaugeMetricFamily(
            "chunkstore_write_queue_depth",
            "Chunks waiting in a tiered store's write-behind queue.",
            labels=["store"],
        )
        queue_capacity = GaugeMetricFamily(
            "chunkstore_write_queue_capacity",
            "Capacity of a tiered store's write-behind queue.",
            labels=["store"],
        )
        up = GaugeMetricFamily(
            "chunkstore_tier_up",
            "1 while a tier answers, 0 while it is in back-off after errors.",
            labels=["tier"],
        )
        for tiered in list(self.tiered):
            health = tiered.health()
            depth.add_metric([tiered.name], health.queue_depth)
            queue_capacity.add_metric([tiered.name], health.queue_capacity)
            for tier_name, is_up in health.tiers_up:
                up.add_metric([tier_name], 1.0 if is_up else 0.0)
        yield from (depth, queue_capacity, up)


def _io_mode_metrics(stores: list[Any]) -> Iterator[Metric]:
    """How filesystem tiers read: the mode in effect and reads around / through the page cache
    (stores with an ``io_stats()``, i.e. :class:`~chunkstore.backends._fs.FsStore`)."""
    mode = GaugeMetricFamily(
        "chunkstore_tier_read_mode",
        "1 for the read mode a filesystem tier uses (auto, direct or buffered after a fallback).",
        labels=["tier", "mode"],
    )
    reads = CounterMetricFamily(
        "chunkstore_tier_reads",
        "Chunk reads of a filesystem tier, by path: direct (O_DIRECT), cached (page cache) "
        "or cold (page cache, dropped after).",
        labels=["tier", "path"],
    )
    for store in stores:
        io_stats = getattr(store, "io_stats", None)
        if not callable(io_stats):
            continue
        stats = io_stats()
        mode.add_metric([store.name, stats.mode], 1.0)
        reads.add_metric([store.name, "direct"], stats.direct_reads)
        reads.add_metric([store.name, "cached"], stats.cached_reads)
        reads.add_metric([store.name, "cold"], stats.cold_reads)
    yield from (mode, reads)


_DEFAULT: ChunkstoreMetrics | None = None
_DEFAULT_LOCK = threading.Lock()


def default_metrics() -> ChunkstoreMetrics:
    """This process's metrics, in prometheus-client's default registry (created on first use).

    Every store and cache built without ``metrics=`` reports here, so an
    engine adapter that bumps the same object shows up next to them::

        from chunkstore.metrics import default_metrics
        default_metrics().record_device_transfer("device_to_host", nbytes, seconds)
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ChunkstoreMetrics()
        return _DEFAULT


def record_device_transfer(direction: str, nbytes: int, seconds: float) -> None:
    """:meth:`ChunkstoreMetrics.record_device_transfer` on :func:`default_metrics`."""
    default_metrics().record_device_transfer(direction, nbytes, seconds)


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    host: str
    """Address it listens on."""
    port: int
    """TCP port (the real one when 0 was asked for)."""
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    port: int, *, host: str = "127.0.0.1", metrics: ChunkstoreMetrics | None = None
) -> MetricsServer:
    """Serve ``/metrics`` for ``metrics`` (default: :func:`default_metrics`) on a daemon thread.

    ``port=0`` picks a free port (read it from the result). Binds to
    127.0.0.1 unless told otherwise: metrics are for the local scraper.
    """
    from prometheus_client import start_http_server

    if not 0 <= port <= 65535:
        raise ConfigError(f"metrics port must be in 0..65535, got {port}")
    registry = (metrics or default_metrics()).registry
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    return MetricsServer(host, int(server.server_address[1]), server, thread)
