"""The events service of ``chunkstore serve``: tell routers what the served stores hold.

Plugged into :data:`chunkstore.cli.commands.serve.SERVICES`; enabled by
``--events``. It publishes vLLM's KV event format (a PUB socket, a replay
socket with ``--events-replay``) from a :class:`~chunkstore.events.StoreAnnouncer`
over every ``--store``, and answers existence queries with ``--events-query``. A store
opened with a capacity index (``--store-option index=URL``) is followed through the index's
change feed between listings.

The query socket answers anyone who reaches it. So a TCP endpoint other than a
loopback address needs ``--events-query-token-file``: only requests carrying
that file's secret are then answered.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

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
        help="ZeroMQ REP endpoint answering which chunks exist, e.g. tcp://127.0.0.1:5559 or "
        "ipc://PATH; any other TCP address needs --events-query-token-file",
    )
    group.add_argument(
        "--events-query-token-file",
        metavar="PATH",
        default=None,
        help='file holding the shared secret every query must carry as its "token" '
        "(the first line, surrounding whitespace stripped); requests without it are refused",
    )
    group.add_argument(
        "--events-query-curve-secret-file",
        metavar="PATH",
        default=None,
        help="file holding the query socket's CurveZMQ secret key (40 Z85 characters, the "
        "first line): requests, tokens and answers are then encrypted; clients need the "
        "public key serve prints at start",
    )
    group.add_argument("--events-topic", metavar="TOPIC", default="", help="topic frame")
    group.add_argument(
        "--events-interval",
        metavar="S",
        type=float,
        default=10.0,
        help="seconds between two listings of the stores (default 10); a store with a "
        "capacity index is also followed through its change feed in between",
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
    if args.events_query_token_file is not None and args.events_query is None:
        raise ConfigError("--events-query-token-file needs --events-query")
    if args.events_query_curve_secret_file is not None and args.events_query is None:
        raise ConfigError("--events-query-curve-secret-file needs --events-query")
    if (
        args.events_query is not None
        and args.events_query_token_file is None
        and not _local_endpoint(args.events_query)
    ):
        raise ConfigError(
            f"--events-query {args.events_query} answers anyone who can connect: bind "
            "tcp://127.0.0.1:PORT or ipc://PATH, or give --events-query-token-file"
        )
    check_seconds(args.events_interval, "--events-interval", minimum=0.01, allow_minimum=True)
    if args.events_max_chunks < 1:
        raise ConfigError(f"--events-max-chunks must be positive, got {args.events_max_chunks}")


def _local_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint only takes connections from this machine.
    ``ipc://`` and ``inproc://`` do, and ``tcp://`` on a loopback address."""
    from chunkstore.cli.peerservice import is_loopback

    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0]
    return scheme == "tcp" and bool(host) and is_loopback(host)


def read_query_token(path: str) -> bytes:
    """The secret in ``path``: its first line, surrounding whitespace stripped."""
    from chunkstore.events._announcer import MAX_QUERY_TOKEN_BYTES

    token = _first_line(path, "--events-query-token-file", MAX_QUERY_TOKEN_BYTES + 2)
    if not token:
        raise ConfigError(f"--events-query-token-file {path}: the file holds no token")
    if len(token) > MAX_QUERY_TOKEN_BYTES:
        raise ConfigError(
            f"--events-query-token-file {path}: a token is at most {MAX_QUERY_TOKEN_BYTES} bytes"
        )
    return token


def read_curve_secret(path: str) -> bytes:
    """The CurveZMQ secret key in ``path`` (its first line, whitespace stripped), checked."""
    from chunkstore.events._announcer import curve_public_key

    option = "--events-query-curve-secret-file"
    secret = _first_line(path, option, 256)
    try:
        curve_public_key(secret)
    except ValueError as exc:
        raise ConfigError(f"{option} {path}: {exc}") from None
    return secret


def _first_line(path: str, option: str, limit: int) -> bytes:
    """The first line of the file ``path`` names (of its first ``limit`` bytes), surrounding
    whitespace stripped; a one-line ConfigError naming ``option`` if it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(limit)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {exc.strerror}") from None
    return head.split(b"\n", 1)[0].strip()


def start_events(context: ServeContext) -> Stop | None:
    args = context.args
    if args.events is None:
        return None
    from chunkstore.cli.storeaccess import header_reader
    from chunkstore.errors import FormatError
    from chunkstore.events import ChunkQuery, EventPublisher, StoreAnnouncer
    from chunkstore.hashing import ChunkKey

    stores = _watched_stores(context)
    readers = [header_reader(store) for store in stores]

    def describe(key: ChunkKey) -> tuple[bytes, list[int]] | None:
        for read in readers:
            try:
                header = read(key)
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
            token = None
            if args.events_query_token_file is not None:
                token = read_query_token(args.events_query_token_file)
            curve = None
            if args.events_query_curve_secret_file is not None:
                curve = read_curve_secret(args.events_query_curve_secret_file)
            query = ChunkQuery(context.store, args.events_query, token=token, curve_secret=curve)
    except BaseException:
        publisher.close()
        _close_all(stores)
        raise
    context.announce(
        f"events: {publisher.endpoint}"
        + (f", replay {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
        + (f", query {query.endpoint}" if query is not None else "")
        + (" (token required)" if query is not None and query.needs_token else "")
        + (
            f" (CurveZMQ, public key {query.curve_public.decode()})"
            if query is not None and query.curve_public is not None
            else ""
        )
        + f", {announcer.held} chunks announced"
    )

    def stop() -> None:
        announcer.close()
        if query is not None:
            query.close()
        publisher.close()
        _close_all(stores)

    return stop


def _watched_stores(context: ServeContext) -> list[Any]:
    """Each ``--store`` opened again, for the announcer alone: its header reads must not
    count as uses, or announcing a store would make every chunk in it look just used."""
    from chunkstore.cli.storeaccess import stop_access_tracking
    from chunkstore.cli.storeargs import open_cli_store

    stores: list[Any] = []
    try:
        for url in context.args.store:
            store = open_cli_store(url, context.args, prefix="store", option="--store")
            stop_access_tracking(store)
            stores.append(store)
    except BaseException:
        _close_all(stores)
        raise
    return stores


def _close_all(stores: list[Any]) -> None:
    for store in stores:
        close = getattr(store, "close", None)
        if close is not None:
            close()
