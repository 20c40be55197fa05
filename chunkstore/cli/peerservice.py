"""The peer service of ``chunkstore serve``: expose the served store to other instances.

Plugged into :data:`chunkstore.cli.commands.serve.SERVICES`; enabled by
``--peer-port``. The secret is read from an environment variable, never from
the command line (where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ConfigError

if TYPE_CHECKING:
    from chunkstore.cli.commands.serve import ServeContext, Stop


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--peer-*`` options."""
    group = parser.add_argument_group(
        "peer server",
        "share the cache with other instances (P/D disaggregation, offloading); "
        "see spec/PROTOCOL.md",
    )
    group.add_argument(
        "--peer-port",
        metavar="N",
        type=int,
        default=None,
        help="serve peers on this TCP port (0: any free port); off when absent",
    )
    group.add_argument(
        "--peer-bind",
        metavar="ADDR",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; set a secret or CURVE before exposing it)",
    )
    group.add_argument(
        "--peer-name", metavar="NAME", default=None, help="name in registries (default host:port)"
    )
    group.add_argument(
        "--peer-secret-env",
        metavar="VAR",
        default="CHUNKSTORE_PEER_SECRET",
        help="environment variable with the shared secret that authenticates "
        "every message (unset: no authentication)",
    )
    group.add_argument(
        "--peer-curve-cert",
        metavar="FILE",
        default=None,
        help="ZeroMQ CURVE secret certificate (zmq.auth.create_certificates): "
        "encrypt the control and inline data traffic",
    )
    group.add_argument(
        "--peer-planes",
        metavar="LIST",
        default="nixl,inline",
        help="data planes to offer, in preference order (default nixl,inline; "
        "nixl is dropped with a reason when NIXL cannot start)",
    )
    group.add_argument(
        "--peer-read-only",
        action="store_true",
        help="refuse pushed chunks and deletes (serve reads only)",
    )
    group.add_argument(
        "--peer-max-lease",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="longest lease a client may hold on served memory (default 30)",
    )
    group.add_argument(
        "--peer-registry",
        metavar="DIR|URL",
        default=None,
        help="announce this server in a registry: a directory on a shared mount, "
        "or redis://host:port/db",
    )
    group.add_argument(
        "--peer-heartbeat",
        metavar="SECONDS",
        type=float,
        default=2.0,
        help="registry heartbeat; the record expires after three (default 2)",
    )
    group.add_argument(
        "--peer-role",
        metavar="ROLE",
        default=None,
        help="free-form label in the registry record (e.g. prefill, decode)",
    )


def start_peer(context: ServeContext) -> Stop | None:
    """Start the peer server (and its registry heartbeat) if ``--peer-port`` is given."""
    args = context.args
    if args.peer_port is None:
        return None
    from chunkstore.backends.peer import Announcer, PeerServer, open_registry

    planes = tuple(p.strip() for p in args.peer_planes.split(",") if p.strip())
    options: dict[str, Any] = {
        "bind": f"tcp://{args.peer_bind}:{args.peer_port}",
        "name": args.peer_name,
        "secret": os.environ.get(args.peer_secret_env) or None,
        "use_env_secret": False,
        "planes": planes,
        "read_only": args.peer_read_only,
        "max_lease_ms": int(args.peer_max_lease * 1000),
        "default_lease_ms": min(5_000, int(args.peer_max_lease * 1000)),
    }
    if getattr(args, "spec", None):
        from chunkstore.backends.registry import load_options
        from chunkstore.format import KVSpec

        spec = KVSpec.from_dict(load_options(args.spec))
        options["fingerprint"] = spec.fingerprint()
        options["chunk_tokens"] = spec.chunk_tokens
    if args.peer_curve_cert:
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(args.peer_curve_cert)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot read CURVE certificate {args.peer_curve_cert}: {exc}"
            ) from None
        if secret is None:
            raise ConfigError(
                f"{args.peer_curve_cert} holds no secret key (use the .key_secret file)"
            )
        options["curve_public_key"], options["curve_secret_key"] = public, secret
    server = PeerServer(context.store, **options).start()
    why = f"; nixl off: {server.nixl_reason}" if server.nixl_reason else ""
    context.announce(
        f"peer: {server.endpoint} (planes: {', '.join(server.planes)}{why}"
        f"{'; authenticated' if server.codec.authenticated else ''})"
    )
    announcer = None
    if args.peer_registry:
        extra = {"role": args.peer_role} if args.peer_role else {}
        registry = open_registry(args.peer_registry)
        try:
            announcer = Announcer(
                registry, lambda: server.info(**extra), interval_s=args.peer_heartbeat
            ).start()
        except BaseException:
            server.stop()
            raise
        context.announce(f"peer: announced in {args.peer_registry} as {server.name}")

    def stop() -> None:
        if announcer is not None:
            announcer.stop()
        server.stop()

    return stop
