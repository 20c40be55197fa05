"""Peer endpoints are checked before ZeroMQ sees them: a typo is one error line, and a
registry record no client can connect to is skipped instead of breaking every read."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.cli.main import main
from chunkstore.errors import ConfigError
from chunkstore.peer import PeerInfo, PeerServer, PeerStore, open_peer_store, open_registry
from chunkstore.peer._client import peer_endpoint
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(2, seed=4)
KEYS = [c.key for c in CHUNKS]
UNUSABLE = ["foo", "10.0.0.7", "tcp://10.0.0.7", "host:port", "127.0.0.1:0", "127.0.0.1:70000"]
UNUSABLE += ["a b:1", "a;b:1", "ipc://", "tcp://ipc:///run/x.sock"]


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        ("tcp://peer-3.example:80", "tcp://peer-3.example:80"),
        ("[::1]:5555", "tcp://[::1]:5555"),
        ("ipc:///run/chunkstore/node.sock", "ipc:///run/chunkstore/node.sock"),
    ],
)
def test_usable_endpoints_are_normalised(text: str, endpoint: str) -> None:
    assert peer_endpoint(text) == endpoint


@pytest.mark.parametrize("text", UNUSABLE)
def test_unusable_endpoints_are_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="peer endpoint"):
        peer_endpoint(text)
    with pytest.raises(ConfigError, match="peer endpoint"):
        PeerStore([text], use_env_secret=False)


def test_a_peer_url_with_a_typo_fails_at_open() -> None:
    with pytest.raises(ConfigError, match="tcp://foo"):
        open_peer_store("peer://127.0.0.1:5555,foo")


def test_peers_command_names_a_bad_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["peers", "--peer", "10.0.0.7", "--probe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--peer" in err and "'10.0.0.7'" in err


def test_a_registry_record_no_client_can_connect_to_is_skipped(tmp_path: Path) -> None:
    backing = MemoryStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS])
    registry = open_registry(str(tmp_path))
    with PeerServer(backing, planes=("inline",), use_env_secret=False, name="good") as server:
        registry.announce(PeerInfo("typo", "tcp://10.0.0.7", expires_at=time.time() + 60), 60)
        registry.announce(server.info(), 60)
        store = PeerStore(
            open_registry(str(tmp_path)), plane="inline", use_env_secret=False, timeout_s=5
        )
        try:
            assert store.lookup_prefix(KEYS) == len(KEYS)
            assert store.get_many(KEYS) == [c.data for c in CHUNKS]
            assert [c.endpoint for c in store.clients()] == [server.endpoint]
        finally:
            store.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_peer_serves_and_is_read() -> None:
    from chunkstore.cli.main import build_parser
    from chunkstore.cli.peerservice import _options

    args = build_parser().parse_args(
        ["serve", "--slot-size", "4KiB", "--peer-port", "0", "--peer-bind", "::1"]
    )
    bind = _options(args)["bind"]
    assert bind == "tcp://[::1]:0"
    backing = MemoryStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS])
    with PeerServer(backing, bind=bind, planes=("inline",), use_env_secret=False) as server:
        assert server.endpoint.startswith("tcp://[::1]:")
        store = PeerStore([server.endpoint], plane="inline", use_env_secret=False, timeout_s=5)
        try:
            assert store.get_many(KEYS) == [c.data for c in CHUNKS]
        finally:
            store.close()
