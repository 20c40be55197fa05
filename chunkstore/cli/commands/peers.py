"""``chunkstore peers``: list the peer servers a registry (or a static list) knows."""

from __future__ import annotations

import argparse
import time
from typing import Any

from chunkstore.cli.commands.serve import check_seconds
from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.storeargs import add_output_options
from chunkstore.cli.table import render_table
from chunkstore.errors import ConfigError
from chunkstore.units import format_size

EPILOG = """examples:
  chunkstore peers --registry /mnt/shared/chunkstore-peers
  chunkstore peers --registry redis://10.0.0.5:6379/0 --probe
  chunkstore peers --peer 127.0.0.1:5555 --peer 127.0.0.1:5556 --probe --json

Without --probe the registry records are shown as announced (EXPIRES: seconds until the
record lapses unless the server's heartbeat renews it). --probe contacts each server
(hello + stats) and adds its round trip, data plane, sessions and open leases. A server
that refuses us (secret, model fingerprint) or does not answer shows why in STATUS.
The shared secret comes from --secret-env (default CHUNKSTORE_PEER_SECRET).

A registry directory that does not exist, or a Redis that does not answer, is an error
(exit 4); a registry that exists but holds no live record prints "no peers" (exit 0).
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``peers`` subcommand."""
    parser = subparsers.add_parser(
        "peers",
        help="list peer servers from a registry or a static list (optionally probe them)",
        description="List the peer servers a registry knows: name, endpoint, model, data planes, "
        "capacity; with --probe, contact each one.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_argument_group("where to look (one of)")
    source.add_argument(
        "--registry",
        metavar="DIR|URL",
        help="registry directory (shared mount), file:///dir or redis://host:port/db",
    )
    source.add_argument(
        "--peer",
        action="append",
        metavar="HOST:PORT",
        default=[],
        help="a server endpoint (repeatable) instead of a registry",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="contact each server: round trip, data plane, sessions, leases",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="per-server timeout for --probe (default 2)",
    )
    parser.add_argument(
        "--plane",
        choices=("auto", "nixl", "inline"),
        default="inline",
        help="data plane to negotiate when probing (default inline: no NIXL "
        "agent is started just to look)",
    )
    parser.add_argument(
        "--secret-env",
        default="CHUNKSTORE_PEER_SECRET",
        metavar="VAR",
        help="environment variable holding the shared secret",
    )
    add_output_options(parser)
    parser.set_defaults(func=run)


def _source(args: argparse.Namespace) -> Any:
    from chunkstore.peer._client import peer_endpoint
    from chunkstore.peer._discovery import StaticPeers, open_registry

    if bool(args.registry) == bool(args.peer):
        raise ConfigError("give either --registry or one or more --peer")
    check_seconds(args.timeout, "--timeout")
    if args.registry:
        return open_registry(args.registry)
    for endpoint in args.peer:
        try:
            peer_endpoint(endpoint)
        except ConfigError as exc:
            raise ConfigError(f"--peer: {exc}") from None
    return StaticPeers(args.peer)


def _list(source: Any) -> list[Any]:
    """The source's peers by name; an unreachable registry raises StoreError (exit 4).

    ``check()`` first: it also refuses a registry directory that does not exist, which
    ``peers()`` lists as empty (no peer has announced into it yet).
    """
    try:
        check = getattr(source, "check", None)
        if check is not None:
            check()
        return sorted(source.peers(), key=lambda i: i.name)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _probe(info: Any, args: argparse.Namespace) -> dict[str, Any]:
    import os

    from chunkstore.peer import PeerClient
    from chunkstore.peer._errors import PeerError

    curve = info.curve_public_key.encode() if info.curve_public_key else None
    client = PeerClient(
        info.endpoint,
        secret=os.environ.get(args.secret_env) or None,
        use_env_secret=False,
        timeout_s=args.timeout,
        retry_after_s=0,
        plane=args.plane,
        curve_server_key=curve,
        recv_arena_bytes=1 << 20,
    )
    try:
        started = time.perf_counter()
        client.hello()
        rtt_ms = (time.perf_counter() - started) * 1000
        stats = client.stats()
        return {
            "status": "ok",
            "rtt_ms": round(rtt_ms, 3),
            "plane": client.plane,
            "plane_reason": client.plane_reason,
            "stats": stats,
        }
    except PeerError as exc:
        return {"status": str(exc)}
    except ConfigError as exc:
        return {"status": f"cannot probe: {exc}"}
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    """List (and optionally probe) peers; exit 1 when a probed peer is unreachable, 4 when
    the registry is."""
    infos = _list(_source(args))
    now = time.time()
    records = []
    for info in infos:
        record: dict[str, Any] = {
            "name": info.name,
            "endpoint": info.endpoint,
            "fingerprint": info.fingerprint,
            "chunk_tokens": info.chunk_tokens,
            "planes": list(info.planes),
            "capacity_bytes": info.capacity_bytes,
            "used_bytes": info.used_bytes,
            "curve": info.curve_public_key is not None,
            "expires_in_s": round(info.expires_at - now, 1) if info.expires_at else None,
            "extra": info.extra,
        }
        if args.probe:
            record["probe"] = _probe(info, args)
        records.append(record)
    failed = args.probe and any(r["probe"]["status"] != "ok" for r in records)
    if args.json:
        emit_json({"peers": records})
        return 1 if failed else 0
    if not records:
        emit_text("no peers")
        return 0
    headers = ["name", "endpoint", "model", "tokens", "planes", "used", "expires"]
    if args.probe:
        headers += ["rtt ms", "plane", "leases", "status"]
    rows = []
    for r in records:
        used = (
            f"{format_size(r['used_bytes'])}/{format_size(r['capacity_bytes'])}"
            if r["capacity_bytes"]
            else "-"
        )
        row: list[Any] = [
            r["name"],
            r["endpoint"],
            (r["fingerprint"] or "any")[:16],
            r["chunk_tokens"] or "-",
            ",".join(r["planes"]) or "-",
            used,
            f"{r['expires_in_s']:g}s" if r["expires_in_s"] is not None else "-",
        ]
        if args.probe:
            probe = r["probe"]
            stats = probe.get("stats", {})
            row += [
                probe.get("rtt_ms", "-"),
                probe.get("plane") or "-",
                stats.get("leases", "-"),
                probe["status"],
            ]
        rows.append(row)
    emit_text(render_table(headers, rows))
    return 1 if failed else 0
