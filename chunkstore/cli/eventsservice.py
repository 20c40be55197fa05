"""The events service of ``chunkstore serve``: tell routers what the served stores hold.

Plugged into :data:`chunkstore.cli.commands.serve.SERVICES`; enabled by
``--events``. It publishes vLLM's KV event format (a PUB socket, a replay
socket with ``--events-replay``) from a :class:`~chunkstore.events.StoreAnnouncer`
over every ``--store``, and answers existence queries with ``--events-query``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from chunkstore.errors import ConfigError

if TYPE_CHECKING:
    from chunkstore.cli.commands.serve import ServeContext, Stop


def add_events_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--events*`` options."""
    group = parser.add_argument_group(
        "events", "publish what the stores hold as vLLM KV events (see docs/events.md)"
    )
    group.add_argument(
        "--events",
        metavar="ENDPOINT",
        default=None,
        help="ZeroMQ PUB endpoint to bind, e.g. tcp://*:5557; off when absent",
    )
    group.add_argument(
        "--events-replay",
        metavar="ENDPOINT",
        default=None,
        help="ZeroMQ ROUTER endpoint for replay requests, e.g. tcp://*:5558",
    )
    group.add_argument(
        "--events-query",
        metavar="ENDPOINT",
        default=None,
        help="ZeroMQ REP endpoint answering which chunks exist, e.g. tcp://*:5559",
    )
    group.add_argument("--events-topic", metavar="TOPIC", default="", help="topic frame")
    group.add_argument(
        "--events-interval",
        metavar="S",
        type=float,
        default=10.0,
        help="seconds between two listings of the stores (default 10)",
    )
    group.add_argument(
        "--events-max-chunks",
        metavar="N",
        type=int,
        default=1_000_000,
        help="most chunks tracked and announced (default 1000000)",
    )


def check_events(args: argparse.Namespace) -> None:
    from chunkstore.cli.commands.serve import check_seconds

    if args.events is None and (args.events_replay or args.events_query):
        raise ConfigError("--events-replay and --events-query need --events")
    check_seconds(args.events_interval, "--events-interval", minimum=0.01, allow_minimum=True)
    if args.events_max_chunks < 1:
        raise ConfigError(f"--events-max-chunks must be positive, got {args.events_max_chunks}")


def start_events(context: ServeContext) -> Stop | None:
    args = context.args
    if args.events is None:
        return None
    from chunkstore.cli.storeaccess import read_header_of
    from chunkstore.errors import FormatError
    from chunkstore.events import ChunkQuery, EventPublisher, StoreAnnouncer
    from chunkstore.hashing import ChunkKey

    stores = [tier.store for tier in context.store.tiers]

    def describe(key: ChunkKey) -> tuple[bytes, list[int]] | None:
        for store in stores:
            try:
                header = read_header_of(store, key)
            except FormatError:
                continue
            if header is not None:
                return header.parent, list(header.tokens)
        return None

    publisher = EventPublisher(
        args.events, replay_endpoint=args.events_replay, topic=args.events_topic
    )
    query: ChunkQuery | None = None
    try:
        announcer = StoreAnnouncer(
            stores,
            publisher,
            describe,
            interval=args.events_interval,
            max_chunks=args.events_max_chunks,
        ).start()
        if args.events_query is not None:
            query = ChunkQuery(context.store, args.events_query)
    except BaseException:
        publisher.close()
        raise
    context.announce(
        f"events: {publisher.endpoint}"
        + (f", replay {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
        + (f", query {query.endpoint}" if query is not None else "")
        + f", {announcer.held} chunks announced"
    )

    def stop() -> None:
        announcer.close()
        if query is not None:
            query.close()
        publisher.close()

    return stop
