"""The peer service of ``chunkstore serve``: expose the served store to other instances.

Plugged into :data:`chunkstore.cli.commands.serve.SERVICES`; enabled by
``--peer-port``. The secret is read from an environment variable, never from
the command line (where ``ps`` would show it).

Authentication never switches itself off by accident: naming a variable with
``--peer-secret-env`` that is unset or empty is an error, and a server bound
to a non-loopback address with neither a secret nor CURVE refuses to start
unless ``--peer-insecure`` says that is intended (it then warns on stderr).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ConfigError

if TYPE_CHECKING:
    from chunkstore.cli.commands.serve import ServeContext, Stop

DEFAULT_SECRET_ENV = "CHUNKSTORE_PEER_SECRET"
"""Where the secret comes from when ``--peer-secret-env`` is not given."""


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
        help="address to listen on (default 127.0.0.1). Any other address needs a secret or "
        "CURVE, or --peer-insecure",
    )
    group.add_argument(
        "--peer-name", metavar="NAME", default=None, help="name in registries (default host:port)"
    )
    group.add_argument(
        "--peer-secret-env",
        metavar="VAR",
        default=None,
        help="environment variable with the shared secret that authenticates every "
        f"message; it must be set and non-empty (default: ${DEFAULT_SECRET_ENV} if set, "
        "else no secret)",
    )
    group.add_argument(
        "--peer-insecure",
        action="store_true",
        help="allow serving a non-loopback --peer-bind with neither a secret nor CURVE "
        "(anyone who can connect may read and push chunks); a warning is still printed",
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
        help="longest lease a client may hold on served memory (default 30; > 0)",
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
        help="registry heartbeat; the record expires after three (default 2; > 0)",
    )
    group.add_argument(
        "--peer-role",
        metavar="ROLE",
        default=None,
        help="free-form label in the registry record (e.g. prefill, decode)",
    )


def _secret(args: argparse.Namespace) -> bytes | None:
    """The shared secret, or None for none; a named but unset or empty variable is an error."""
    var = args.peer_secret_env
    if var is None:
        var = DEFAULT_SECRET_ENV
        if var not in os.environ:
            return None
    value = os.environ.get(var)
    if value is None:
        raise ConfigError(f"--peer-secret-env {var}: the variable is not set")
    if not value:
        raise ConfigError(
            f"{var} is set but empty: set the shared secret, or unset {var} to serve without one"
            if args.peer_secret_env is None
            else f"--peer-secret-env {var}: the variable is empty"
        )
    return value.encode()


def _curve_keys(path: str) -> tuple[bytes, bytes]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE certificate {path}: {exc}") from None
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


def is_loopback(address: str) -> bool:
    """Whether a ``--peer-bind`` address only accepts connections from this machine.

    ``*``, interface names and host names other than ``localhost`` count as exposed:
    they may resolve to, or be, a public interface.
    """
    host = address.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, as an endpoint needs it (``::1`` -> ``[::1]``)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _auth_label(secret: bytes | None, curve: bool) -> str:
    return (
        "+".join(name for name, on in (("hmac", secret is not None), ("curve", curve)) if on)
        or "off"
    )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Check every ``--peer-*`` option and build the PeerServer options; raises ConfigError."""
    from chunkstore.cli.commands.serve import check_port, check_seconds

    check_port(args.peer_port, "--peer-port")
    check_seconds(args.peer_max_lease, "--peer-max-lease", minimum=0.001, allow_minimum=True)
    check_seconds(args.peer_heartbeat, "--peer-heartbeat")
    planes = tuple(p.strip() for p in args.peer_planes.split(",") if p.strip())
    unknown = sorted(set(planes) - {"nixl", "inline"})
    if not planes or unknown:
        raise ConfigError(f"--peer-planes takes nixl and/or inline, got {args.peer_planes!r}")
    if args.peer_registry:
        from chunkstore.peer import open_registry

        registry = open_registry(args.peer_registry)  # rejects unknown schemes; no I/O yet
        close = getattr(registry, "close", None)
        if close is not None:
            close()
    secret = _secret(args)
    options: dict[str, Any] = {
        "bind": f"tcp://{_bracketed(args.peer_bind)}:{args.peer_port}",
        "name": args.peer_name,
        "secret": secret,
        "use_env_secret": False,
        "planes": planes,
        "read_only": args.peer_read_only,
        "max_lease_ms": int(args.peer_max_lease * 1000),
        "default_lease_ms": min(5_000, int(args.peer_max_lease * 1000)),
    }
    if args.peer_curve_cert:
        options["curve_public_key"], options["curve_secret_key"] = _curve_keys(args.peer_curve_cert)
    if (
        secret is None
        and not args.peer_curve_cert
        and not is_loopback(args.peer_bind)
        and not args.peer_insecure
    ):
        raise ConfigError(
            f"--peer-bind {args.peer_bind} exposes the cache without authentication: set a "
            f"secret (${DEFAULT_SECRET_ENV} or --peer-secret-env VAR), give --peer-curve-cert, "
            "or pass --peer-insecure if that is intended"
        )
    options.update(served_model(args))
    return options


def served_model(args: argparse.Namespace) -> dict[str, Any]:
    """``fingerprint`` and ``chunk_tokens`` of the ``--spec`` model (clients of another model
    are refused), or nothing without ``--spec``."""
    if not getattr(args, "spec", None):
        return {}
    from chunkstore.backends._registry import load_options
    from chunkstore.format import KVSpec

    spec = KVSpec.from_dict(load_options(args.spec))
    return {"fingerprint": spec.fingerprint(), "chunk_tokens": spec.chunk_tokens}


def check_peer(args: argparse.Namespace) -> None:
    """Check the ``--peer-*`` options before anything starts (they matter only with --peer-port)."""
    if args.peer_port is None:
        if args.peer_registry:
            raise ConfigError("--peer-registry needs --peer-port (the peer server is off)")
        return
    _options(args)


def start_peer(context: ServeContext) -> Stop | None:
    """Start the peer server (and its registry heartbeat) if ``--peer-port`` is given."""
    args = context.args
    if args.peer_port is None:
        return None
    from chunkstore.peer import Announcer, PeerServer, open_registry

    options = _options(args)
    auth = _auth_label(options["secret"], "curve_secret_key" in options)
    if auth == "off" and not is_loopback(args.peer_bind):
        print(
            f"chunkstore serve: warning: peer server on {args.peer_bind} accepts anyone "
            "(no secret, no CURVE; --peer-insecure): every client can read and push chunks",
            file=sys.stderr,
            flush=True,
        )
    server = PeerServer(context.store, **options).start()
    why = f"; nixl off: {server.nixl_reason}" if server.nixl_reason else ""
    context.announce(
        f"peer: {server.endpoint} (planes: {', '.join(server.planes)}{why}; auth: {auth})"
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
