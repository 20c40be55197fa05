"""``chunkstore peers``: registry listing and probing."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.cli import peerservice
from chunkstore.cli.commands import serve
from chunkstore.cli.main import build_parser, main
from chunkstore.peer import FileRegistry, PeerInfo, PeerServer

pytestmark = pytest.mark.timeout(60)


def test_peers_lists_and_probes_a_registry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CHUNKSTORE_PEER_SECRET", raising=False)
    registry = FileRegistry(tmp_path)
    with PeerServer(
        MemoryStore(), staging_bytes=1 << 20, use_env_secret=False, name="prefill-0"
    ) as server:
        registry.announce(server.info(role="prefill"), 30)
        assert main(["peers", "--registry", str(tmp_path), "--probe", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)["peers"]
        assert [p["name"] for p in listed] == ["prefill-0"]
        assert listed[0]["endpoint"] == server.endpoint
        assert listed[0]["extra"] == {"role": "prefill"}
        assert listed[0]["probe"]["status"] == "ok"
        assert listed[0]["probe"]["stats"]["sessions"] == 1
        assert main(["peers", "--registry", str(tmp_path)]) == 0
        text = capsys.readouterr().out
        assert "prefill-0" in text and server.endpoint in text
    registry.announce(PeerInfo("gone", server.endpoint), 30)  # stopped, record still fresh
    assert (
        main(
            [
                "peers",
                "--peer",
                server.endpoint.removeprefix("tcp://"),
                "--probe",
                "--timeout",
                "0.3",
            ]
        )
        == 1
    )
    assert "did not answer" in capsys.readouterr().out


def test_peers_needs_one_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["peers"]) == 2
    assert "--registry" in capsys.readouterr().err


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_peers_with_a_missing_or_unreachable_registry_is_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    for registry, why in [
        (str(tmp_path / "typo"), "no such directory"),
        (str(tmp_path / "a-file"), "not a directory"),
        (f"redis://127.0.0.1:{closed_port()}/0", "Redis unreachable"),
    ]:
        for extra in ([], ["--json"]):
            assert main(["peers", "--registry", registry, *extra]) == 4, registry
            out, err = capsys.readouterr()
            assert out == "" and why in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "typo").exists()
    # a registry that is there but empty is not an error
    (tmp_path / "empty").mkdir()
    assert main(["peers", "--registry", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.strip() == "no peers"


def test_peers_lists_an_empty_redis_registry(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["peers", "--registry", redis_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"peers": []}


SERVE = ["serve", "--slot-size", "16KiB", "--host-cache", "64KiB"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--peer-port", "70000"], "--peer-port must be a TCP port in 0..65535"),
        (["--peer-port", "-1"], "--peer-port must be a TCP port in 0..65535"),
        (["--peer-port", "0", "--peer-max-lease", "0"], "--peer-max-lease must be"),
        (["--peer-port", "0", "--peer-max-lease", "nan"], "--peer-max-lease must be"),
        (
            ["--peer-port", "0", "--peer-heartbeat", "-1", "--peer-registry", "REG"],
            "--peer-heartbeat must be",
        ),
        (["--peer-port", "0", "--peer-heartbeat", "0"], "--peer-heartbeat must be"),
        (["--peer-port", "0", "--peer-planes", "rdma"], "--peer-planes"),
        (["--peer-registry", "REG"], "--peer-registry needs --peer-port"),
        (["--peer-port", "0", "--peer-registry", "ftp://x"], "unknown registry"),
        (
            ["--peer-port", "0", "--peer-secret-env", "CHUNKSTORE_TEST_UNSET"],
            "--peer-secret-env CHUNKSTORE_TEST_UNSET: the variable is not set",
        ),
        (
            ["--peer-port", "0", "--peer-secret-env", "CHUNKSTORE_TEST_EMPTY"],
            "--peer-secret-env CHUNKSTORE_TEST_EMPTY: the variable is empty",
        ),
        (["--peer-port", "0", "--peer-bind", "0.0.0.0"], "--peer-insecure"),
        (["--peer-port", "0", "--peer-bind", "*"], "without authentication"),
    ],
)
def test_serve_rejects_bad_peer_options_before_starting_anything(
    options: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CHUNKSTORE_PEER_SECRET", raising=False)
    monkeypatch.delenv("CHUNKSTORE_TEST_UNSET", raising=False)
    monkeypatch.setenv("CHUNKSTORE_TEST_EMPTY", "")
    registry = tmp_path / "registry"
    options = [str(registry) if o == "REG" else o for o in options]
    # metrics first: a half-started serve would have printed its metrics line already
    assert main([*SERVE, "--metrics-port", "0", *options]) == 2
    out, err = capsys.readouterr()
    assert out == "", out  # nothing started, nothing announced
    assert err.startswith("chunkstore serve: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not registry.exists()


def test_an_empty_default_secret_variable_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKSTORE_PEER_SECRET", "")
    assert main([*SERVE, "--peer-port", "0"]) == 2
    assert "CHUNKSTORE_PEER_SECRET is set but empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("[::1]", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("*", False),
        ("10.0.0.5", False),
        ("eth0", False),
        ("[::]", False),
        ("node7.example", False),
    ],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    assert peerservice.is_loopback(address) is loopback


def serve_briefly(argv: list[str]) -> None:
    """Run ``serve`` until it has announced itself, then stop it."""
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    stop.set()  # serve starts every service, prints its lines, then stops at once
    assert serve.run(args, stop_event=stop) == 0


def test_serve_says_which_authentication_is_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CHUNKSTORE_PEER_SECRET", raising=False)
    inline = [*SERVE, "--peer-port", "0", "--peer-planes", "inline"]
    serve_briefly(inline)
    out, err = capsys.readouterr()
    assert "auth: off" in out and err == ""  # loopback without a secret: allowed, quietly
    monkeypatch.setenv("CHUNKSTORE_PEER_SECRET", "shh")  # the default variable, when set
    serve_briefly(inline)
    assert "auth: hmac" in capsys.readouterr().out
    monkeypatch.setenv("MY_SECRET", "shh")
    serve_briefly([*inline, "--peer-secret-env", "MY_SECRET"])
    assert "auth: hmac" in capsys.readouterr().out
    # an exposed address without authentication needs --peer-insecure, and still warns.
    # (The test binds loopback and lets is_loopback say otherwise: tests stay on 127.0.0.1.)
    monkeypatch.delenv("CHUNKSTORE_PEER_SECRET")
    monkeypatch.setattr(peerservice, "is_loopback", lambda address: False)
    assert main(inline) == 2
    assert "--peer-insecure" in capsys.readouterr().err
    serve_briefly([*inline, "--peer-insecure"])
    out, err = capsys.readouterr()
    assert "auth: off" in out
    assert "warning: peer server on 127.0.0.1 accepts anyone" in err


def test_serve_with_curve_and_an_exposed_address_needs_no_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import zmq.auth

    monkeypatch.delenv("CHUNKSTORE_PEER_SECRET", raising=False)
    _, secret_file = zmq.auth.create_certificates(str(tmp_path), "server")
    monkeypatch.setattr(peerservice, "is_loopback", lambda address: False)
    serve_briefly(
        [*SERVE, "--peer-port", "0", "--peer-planes", "inline", "--peer-curve-cert", secret_file]
    )
    out, err = capsys.readouterr()
    assert "auth: curve" in out and err == ""


def test_serve_runs_a_peer_server_over_its_tiered_store(
    plane: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from chunkstore.peer import PeerStore
    from chunkstore.testing.factories import sample_chunks

    monkeypatch.setenv("TEST_PEER_SECRET", "shh")
    chunks = sample_chunks(4, seed=8)
    registry = tmp_path / "registry"
    args = build_parser().parse_args(
        [
            "serve",
            "--slot-size",
            "16KiB",
            "--host-cache",
            "256KiB",
            "--store",
            str(tmp_path / "fs"),
            "--create",
            "--peer-port",
            "0",
            "--peer-registry",
            str(registry),
            "--peer-role",
            "decode",
            "--peer-secret-env",
            "TEST_PEER_SECRET",
        ]
    )
    stop = threading.Event()
    thread = threading.Thread(target=serve.run, args=(args,), kwargs={"stop_event": stop})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not list(registry.glob("*.peer.json")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        store = PeerStore(
            FileRegistry(registry),
            secret="shh",
            use_env_secret=False,
            plane=plane,
            recv_arena_bytes=1 << 20,
        )
        try:
            assert store.put_many([(c.key, c.data) for c in chunks]) == [True] * 4  # offload
            assert store.lookup_prefix([c.key for c in chunks]) == 4
            assert [bytes(g or b"") for g in store.get_many([c.key for c in chunks])] == [
                c.data for c in chunks
            ]
            assert list(store.dataplanes().values()) == [plane]
        finally:
            store.close()
    finally:
        stop.set()
        thread.join(30)
    out = capsys.readouterr().out
    assert "peer: tcp://127.0.0.1:" in out and "auth: hmac" in out
    assert not list(registry.glob("*.peer.json"))  # withdrawn on shutdown
    assert len(list((tmp_path / "fs").rglob("*.kvc"))) == 4  # written behind to the tier
