"""`chunkstore demo` writes, reuses and verifies chunks in a real directory store."""

from __future__ import annotations

from chunkstore.backends._registry import open_store
from chunkstore.cache import DEFAULT_POLICY
from chunkstore.cli.main import main
from chunkstore.demo import DEMO_SPEC, conversations, run_store_demo
from chunkstore.format import ChunkLayout, decode_chunk


def test_demo_twice_reuses_everything_the_first_run_wrote(tmp_path) -> None:
    with open_store(str(tmp_path / "s"), create=True) as store:
        first = run_store_demo(store, out=lambda _: None)
    chats = conversations(DEMO_SPEC.chunk_tokens)
    distinct = 4 + sum(len(t[-1]) // DEMO_SPEC.chunk_tokens - 4 for t in chats.values())
    assert first.chunks_written == distinct
    assert first.verified_chunks == 4
    with open_store(str(tmp_path / "s")) as store:
        second = run_store_demo(store, out=lambda _: None)
        listed = list(store.list())
    assert second.chunks_written == 0
    assert second.chunks_reused == first.chunks_reused + first.chunks_written
    assert second.keys == first.keys
    assert len(listed) == distinct
    size = ChunkLayout(DEMO_SPEC).total_size
    assert all(info.size == size for info in listed)


def test_demo_command_prints_what_it_did(tmp_path, capsys) -> None:
    assert main(["demo", "--store", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "computed and written" in out and "verified byte for byte" in out
    assert f"host memory ({DEFAULT_POLICY} policy," in out  # the tiered part runs the default
    chunk_files = list((tmp_path / "d").rglob("*.kvc"))
    assert chunk_files
    # The tiered demo writes chunks of its own spec into the same store: look for ours.
    fingerprints = {decode_chunk(p.read_bytes()).header.fingerprint for p in chunk_files}
    assert DEMO_SPEC.fingerprint() in fingerprints
