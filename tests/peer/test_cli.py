"""``chunkstore peers``: registry listing and probing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from chunkstore.backends.memory import MemoryStore
from chunkstore.backends.peer import FileRegistry, PeerInfo, PeerServer
from chunkstore.cli.main import main

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


def test_serve_runs_a_peer_server_over_its_tiered_store(
    plane: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from chunkstore.backends.peer import PeerStore
    from chunkstore.cli.commands import serve
    from chunkstore.cli.main import build_parser
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
    assert "peer: tcp://127.0.0.1:" in out and "authenticated" in out
    assert not list(registry.glob("*.peer.json"))  # withdrawn on shutdown
    assert len(list((tmp_path / "fs").rglob("*.kvc"))) == 4  # written behind to the tier
