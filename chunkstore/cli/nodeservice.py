"""The node service of ``chunkstore serve``: one host cache for every engine of the machine.

Plugged into :data:`chunkstore.cli.commands.serve.SERVICES`; enabled by
``--node PATH``. The served host pool goes to ``/dev/shm`` (``--shm-name``,
or a name derived from the process id), engines attach over the unix socket
``PATH`` (created 0600) and map the pool (spec/PROTOCOL.md, plane ``shm``).
A shared secret is optional: only the socket's owner can connect anyway.
With ``--node-events`` the host cache's changes are published as vLLM KV
events (:class:`~chunkstore.events.CacheAnnouncer`).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ConfigError

if TYPE_CHECKING:
    from chunkstore.cli.commands.serve import ServeContext, Stop


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--node*`` options."""
    group = parser.add_argument_group(
        "node service",
        "one host cache for every engine of this machine (connector option 'node'); "
        "see docs/cache.md",
    )
    group.add_argument(
        "--node",
        metavar="PATH",
        default=None,
        help="serve the engines of this machine on this unix socket (created owner-only); "
        "the host pool is put in /dev/shm",
    )
    group.add_argument(
        "--node-secret-env",
        metavar="VAR",
        default=None,
        help="environment variable with a shared secret every engine must present "
        "(default: none; the socket is owner-only)",
    )
    group.add_argument(
        "--node-events",
        metavar="ENDPOINT",
        default=None,
        help="publish what the node's host cache holds as vLLM KV events on this ZeroMQ PUB "
        "endpoint, e.g. tcp://*:5560 (see docs/events.md); off when absent",
    )
    group.add_argument(
        "--node-events-replay",
        metavar="ENDPOINT",
        default=None,
        help="ZeroMQ ROUTER endpoint for replay requests of --node-events, e.g. tcp://*:5561",
    )
    group.add_argument(
        "--node-events-topic", metavar="TOPIC", default="", help="topic frame of --node-events"
    )


def shared_pool(args: argparse.Namespace) -> tuple[str | None, bool]:
    """The host pool's shared-memory name and whether a leftover of that name is replaced.

    ``--shm-name`` (replaced only with ``--shm-replace``); else, with ``--node``, a
    name derived from the socket path, so a service restarted after ``kill -9``
    replaces its own leftover instead of leaking it (:func:`check_node` has made
    sure no live service owns it); else a private pool.
    """
    if args.shm_name:
        return str(args.shm_name), bool(args.shm_replace)
    if getattr(args, "node", None):
        import hashlib  # here: it loads OpenSSL, which every `chunkstore --help` would pay for

        endpoint = _options(args)["bind"]
        digest = hashlib.blake2b(endpoint.encode(), digest_size=6).hexdigest()
        return f"chunkstore-node-{digest}", True
    return None, bool(args.shm_replace)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from chunkstore.cli.peerservice import served_model
    from chunkstore.node import node_endpoint

    secret = None
    if args.node_secret_env is not None:
        value = os.environ.get(args.node_secret_env)
        if not value:
            raise ConfigError(f"--node-secret-env {args.node_secret_env}: the variable is unset")
        secret = value.encode()
    try:
        endpoint = node_endpoint(args.node)
    except ConfigError as exc:
        raise ConfigError(f"--node: {exc}") from None
    return {
        "bind": endpoint,
        "name": "node",
        "secret": secret,
        "use_env_secret": False,
        "planes": ("shm",),
        "seal_layout": _layout(args),
        **served_model(args),
    }


def _layout(args: argparse.Namespace) -> Any:
    """The ``--spec`` model's chunk layout: with it the service seals TP engines' chunks."""
    if not getattr(args, "spec", None):
        return None
    from chunkstore.backends._registry import load_options
    from chunkstore.format import ChunkLayout, KVSpec

    return ChunkLayout(KVSpec.from_dict(load_options(args.spec)))


def check_node(args: argparse.Namespace) -> None:
    """Check the ``--node*`` options before anything starts."""
    if args.node is None:
        if args.node_secret_env is not None:
            raise ConfigError("--node-secret-env needs --node (the node service is off)")
        if args.node_events is not None:
            raise ConfigError("--node-events needs --node (the node service is off)")
    if args.node_events is None and args.node_events_replay is not None:
        raise ConfigError("--node-events-replay needs --node-events")
    if args.node_events_topic and args.node_events is None:
        raise ConfigError("--node-events-topic needs --node-events")
    if args.node is None:
        return
    options = _options(args)
    from chunkstore.peer._localsocket import answers, socket_path

    path = socket_path(options["bind"])
    if not path.parent.is_dir():
        raise ConfigError(f"--node {path}: directory {path.parent} does not exist")
    if answers(path):
        raise ConfigError(f"--node {path}: another node service is running there")


def start_node(context: ServeContext) -> Stop | None:
    """Start the node service if ``--node`` is given."""
    args = context.args
    if args.node is None:
        return None
    from chunkstore.node import NodeServer

    options = _options(args)
    host = context.store.host
    # Events first: the announcer listens before any engine can store a chunk.
    stop_events = _start_node_events(context)
    try:
        server = NodeServer(context.store, **options).start()
    except BaseException:
        if stop_events is not None:
            stop_events()
        raise
    context.announce(
        f"node: {options['bind'].removeprefix('ipc://')} (pool /dev/shm/{host.pool.name}, "
        f"{host.num_slots} slots of {host.slot_size} B; "
        f"auth: {'hmac' if options['secret'] else 'socket owner only'})"
    )

    def stop() -> None:
        try:
            server.stop()
        finally:
            if stop_events is not None:
                stop_events()

    return stop


def _start_node_events(context: ServeContext) -> Stop | None:
    """Publish the host cache's changes if ``--node-events`` is given."""
    args = context.args
    if args.node_events is None:
        return None
    from chunkstore.events import CacheAnnouncer, EventPublisher

    try:
        publisher = EventPublisher(
            args.node_events, replay_endpoint=args.node_events_replay, topic=args.node_events_topic
        )
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - zmq's errors: a bad or busy endpoint
        replay = args.node_events_replay
        flags = f"--node-events {args.node_events}"
        if replay is not None:
            flags += f" / --node-events-replay {replay}"
        raise ConfigError(f"{flags}: {exc}") from None
    try:
        announcer = CacheAnnouncer(context.store.host, publisher).start()
    except BaseException:
        publisher.close()
        raise
    context.announce(
        f"node events: {publisher.endpoint}"
        + (f", replay {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
        + f", {announcer.held} chunks announced"
    )

    def stop() -> None:
        try:
            announcer.close()
        finally:
            publisher.close()

    return stop
