"""``chunkstore serve``: run a host cache (in front of optional tiers) with its services.

``serve`` builds one :class:`~chunkstore.tiering.TieredStore` from the options
(host memory first, then every ``--store`` in order), starts each enabled
service, and blocks until SIGINT/SIGTERM; then it stops the services in
reverse order and closes the store (flushing pending write-backs).

Services are a small list, :data:`SERVICES`: each adds its own options,
checks them, and, if its options enable it, starts and returns a stop
function. Metrics is the first one. A peer server plugs in the same way,
without touching the rest::

    SERVICES.append(Service("peer", add_peer_arguments, start_peer, check_peer))

from chunkstore.cli.nodeservice import (  # noqa: E402
    add_node_arguments,
    check_node,
    shared_pool,
    start_node,
)

SERVICES.append(Service("node", add_node_arguments, start_node, check_node))

where ``start_peer(context)`` serves ``context.store`` and returns its stop.
Every option of every service is checked before the store is opened or
anything is started or printed: a mistake is one line and exit code 2, never
a half-started server.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.cache import DEFAULT_POLICY, POLICY_NAMES
from chunkstore.cli.storeargs import add_store_options, local_path, open_cli_store, size_arg
from chunkstore.errors import ConfigError, StoreError
from chunkstore.units import MAX_SECONDS, format_size, parse_size, shown

if TYPE_CHECKING:
    from chunkstore.metrics import ChunkstoreMetrics
    from chunkstore.tiering import TieredStore


@dataclass(frozen=True, slots=True)
class ServeContext:
    """What a service gets when it starts."""

    args: argparse.Namespace
    """The parsed command line (every service's options)."""
    store: TieredStore
    """The store to serve: host memory first, then the ``--store`` tiers."""
    metrics: ChunkstoreMetrics
    """The metrics every service records into."""
    announce: Callable[[str], None]
    """Print one line for the operator (flushed at once: tests and supervisors read it)."""


Stop = Callable[[], None]


def _no_check(args: argparse.Namespace) -> None:
    """A service whose options need no checking beyond argparse's."""


@dataclass(frozen=True, slots=True)
class Service:
    """One thing ``serve`` can run next to the store."""

    name: str
    """Short name, for messages."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the service's options to the ``serve`` parser."""
    start: Callable[[ServeContext], Stop | None]
    """Starts the service if its options ask for it; returns how to stop it, or None."""
    check: Callable[[argparse.Namespace], None] = _no_check
    """Raises :class:`ConfigError` (naming the flag) for a bad option; runs before anything
    starts, so a mistake never leaves a service half started."""


MAX_QUEUE_SIZE = 1 << 20
"""Most chunks waiting for write-back (each holds a host slot: more could never be used)."""


def check_port(value: int | None, flag: str) -> None:
    """A TCP port option: absent, or 0..65535 (0: any free port)."""
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(
            f"{flag} must be a TCP port in 0..65535 (0: any free port), got {shown(value)}"
        )


def check_seconds(
    value: float, flag: str, *, minimum: float = 0.0, allow_minimum: bool = False
) -> None:
    """A duration option: above ``minimum`` (or equal to it with ``allow_minimum``) and at most
    :data:`~chunkstore.units.MAX_SECONDS` (so it can be any wait's timeout)."""
    ok = math.isfinite(value) and (value >= minimum if allow_minimum else value > minimum)
    if not ok or value > MAX_SECONDS:
        bound = f">= {minimum:g}" if allow_minimum else f"> {minimum:g}"
        raise ConfigError(
            f"{flag} must be a number of seconds {bound} and <= {MAX_SECONDS:g}, got {value:g}"
        )


def _add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument(
        "--metrics-port",
        metavar="N",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: any free port)",
    )
    group.add_argument(
        "--metrics-host",
        metavar="ADDR",
        default="127.0.0.1",
        help="address for /metrics (default: 127.0.0.1)",
    )


def _check_metrics(args: argparse.Namespace) -> None:
    check_port(args.metrics_port, "--metrics-port")


def _start_metrics(context: ServeContext) -> Stop | None:
    port = context.args.metrics_port
    if port is None:
        return None
    from chunkstore.metrics import start_metrics_server

    server = start_metrics_server(port, host=context.args.metrics_host, metrics=context.metrics)
    context.announce(f"metrics: {server.url}")
    return server.close


SERVICES: list[Service] = [
    Service("metrics", _add_metrics_arguments, _start_metrics, _check_metrics)
]
"""Services in start order (stopped in reverse)."""

from chunkstore.cli.peerservice import add_peer_arguments, check_peer, start_peer  # noqa: E402

SERVICES.append(Service("peer", add_peer_arguments, start_peer, check_peer))

from chunkstore.cli.nodeservice import (  # noqa: E402
    add_node_arguments,
    check_node,
    shared_pool,
    start_node,
)

SERVICES.append(Service("node", add_node_arguments, start_node, check_node))

from chunkstore.cli.eventsservice import add_events_arguments, check_events, start_events  # noqa: E402

SERVICES.append(Service("events", add_events_arguments, start_events, check_events))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run a host-memory chunk cache in front of stores, with /metrics (and peers)",
        description=(
            "Keeps a host-memory cache of chunks (parc, ARC or LRU over a preallocated, optionally "
            "shared slot pool) in front of zero or more stores, writes behind to them, and "
            "serves it until interrupted (Ctrl-C or SIGTERM flushes pending writes)."
        ),
        epilog="example:\n  chunkstore serve --host-cache 64G --slot-size 16MiB "
        "--store /mnt/kv --metrics-port 9400\n"
        "  chunkstore serve --host-cache 8G --slot-size 16MiB --store /mnt/shared/kv \\\n"
        "    --store-option index=redis://10.0.0.5:6379/0 --events tcp://*:5557\n\n"
        "Every --store must exist already (a mistyped path is an error, not a new empty\n"
        "cache); give --create to make missing ones. With a capacity index (the index\n"
        "store option), --events follows the store's changes as its writers make them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cache = parser.add_argument_group("host cache")
    cache.add_argument(
        "--host-cache",
        metavar="SIZE",
        type=size_arg,
        default=parse_size("1G"),
        help="host memory for chunks (default: 1G)",
    )
    cache.add_argument(
        "--slot-size",
        metavar="SIZE",
        type=size_arg,
        default=None,
        help="bytes per chunk slot: the model's chunk size (or use --spec)",
    )
    cache.add_argument(
        "--spec",
        metavar="FILE",
        default=None,
        help="KV spec JSON/YAML of the model: the slot size is its chunk size",
    )
    cache.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=DEFAULT_POLICY,
        help=f"replacement policy (default: {DEFAULT_POLICY}, prefix-aware ARC; see docs/cache.md)",
    )
    cache.add_argument(
        "--shm-name",
        metavar="NAME",
        default=None,
        help="put the pool in /dev/shm/NAME so other processes can attach it",
    )
    cache.add_argument(
        "--shm-replace",
        action="store_true",
        help="remove a leftover pool of the same name first (after a crash)",
    )
    tiers = parser.add_argument_group("secondary tiers")
    tiers.add_argument(
        "--store",
        metavar="URL",
        action="append",
        default=[],
        help="a store behind host memory (repeatable; looked up in order); "
        "it must exist unless --create is given",
    )
    tiers.add_argument(
        "--create",
        action="store_true",
        help="create a --store directory that does not exist yet; an S3 bucket must exist "
        "(default: a missing store is an error, so a typo never starts an empty cache)",
    )
    add_store_options(tiers, "store", who="every --store")
    tiers.add_argument(
        "--write-tiers",
        choices=("all", "first"),
        default="all",
        help="write behind to every store or to the first only (default: all)",
    )
    tiers.add_argument(
        "--queue-size",
        metavar="N",
        type=int,
        default=256,
        help="write-behind queue length (default: 256); writes beyond it are dropped and counted",
    )
    tiers.add_argument(
        "--tier-timeout",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="a store call slower than this is a miss (default: 30)",
    )
    tiers.add_argument(
        "--retry-after",
        metavar="SECONDS",
        type=float,
        default=5.0,
        help="back-off before a failed store is tried again (default: 5)",
    )
    for service in SERVICES:
        service.add_arguments(parser)
    parser.set_defaults(func=run)


def slot_size_from(args: argparse.Namespace) -> int:
    """The slot size: ``--slot-size``, or the chunk size of ``--spec``."""
    if (args.slot_size is None) == (args.spec is None):
        raise ConfigError("give exactly one of --slot-size or --spec (the chunk size)")
    if args.slot_size is not None:
        return int(args.slot_size)
    from chunkstore.backends._registry import load_options
    from chunkstore.format import ChunkLayout, KVSpec

    return ChunkLayout(KVSpec.from_dict(load_options(args.spec))).total_size


def check_options(args: argparse.Namespace) -> None:
    """Check the numeric options of the cache and every service; raises ConfigError."""
    if not 1 <= args.queue_size <= MAX_QUEUE_SIZE:
        raise ConfigError(
            f"--queue-size must be at least 1 and at most {MAX_QUEUE_SIZE}, "
            f"got {shown(args.queue_size)}"
        )
    check_seconds(args.tier_timeout, "--tier-timeout")
    check_seconds(args.retry_after, "--retry-after", allow_minimum=True)
    for service in SERVICES:
        service.check(args)


def _check_stores_exist(args: argparse.Namespace) -> None:
    # Opening with create=False already refuses a missing local directory; saying so here
    # names the flag that would make it (the generic store error cannot).
    if args.create:
        return
    for url in args.store:
        path = local_path(url)
        if path is not None and not path.exists():
            raise StoreError(
                f"--store {url}: no such directory (give --create to start a new store there)"
            )


def build_store(args: argparse.Namespace, metrics: ChunkstoreMetrics) -> TieredStore:
    """The tiered store the options describe (missing stores are made only with --create)."""
    from chunkstore.cache import HostCache
    from chunkstore.tiering import TieredStore

    _check_stores_exist(args)
    shm_name, shm_replace = shared_pool(args)
    host = HostCache(
        slot_size_from(args),
        capacity_bytes=args.host_cache,
        policy=args.policy,
        shm_name=shm_name,
        shm_replace=shm_replace,
    )
    tiers = []
    try:
        for url in args.store:
            tiers.append(
                open_cli_store(url, args, prefix="store", create=args.create, option="--store")
            )
        return TieredStore(
            host,
            tiers,
            write_tiers=args.write_tiers,
            queue_size=args.queue_size,
            tier_timeout=args.tier_timeout,
            retry_after=args.retry_after,
            metrics=metrics,
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        host.close()
        raise


def run(args: argparse.Namespace, *, stop_event: threading.Event | None = None) -> int:
    stop = stop_event or threading.Event()

    def announce(line: str) -> None:
        print(line, flush=True)

    check_options(args)
    from chunkstore.metrics import default_metrics

    metrics = default_metrics()
    store = build_store(args, metrics)
    stops: list[Stop] = []
    previous: dict[signal.Signals, Any] = {}
    try:
        context = ServeContext(args, store, metrics, announce)
        for service in SERVICES:
            stopper = service.start(context)
            if stopper is not None:
                stops.append(stopper)
        host = store.host
        announce(
            f"serving: host cache {format_size(host.capacity_bytes)} "
            f"({host.num_slots} slots of {format_size(host.slot_size)}, {host.policy_name}"
            f"{', shared as ' + str(host.pool.name) if host.pool.name else ''}), "
            f"tiers: {', '.join(t.name for t in store.tiers) or 'none'}"
        )
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, lambda *_: stop.set())
        stop.wait()
        announce("stopping: flushing pending writes")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for stopper in reversed(stops):
            try:
                stopper()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"chunkstore serve: stopping a service failed: {exc}", file=sys.stderr)
        store.close()
    return 0
