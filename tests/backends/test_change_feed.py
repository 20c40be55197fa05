"""A shared store's change feed (real redis-server on 127.0.0.1): what the capacity index's
steps append, as another node reads it, and the gaps that send a reader back to a listing."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkstore.backends._feed import ChangeFeed
from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks

pytest.importorskip("redis")

CHUNKS = sample_chunks(8, seed=11)
SIZE = len(CHUNKS[0].data)


def final_state(changes: list[tuple[bool, object]]) -> dict[object, bool]:
    state: dict[object, bool] = {}
    for stored, key in changes:
        state[key] = stored
    return state


def read_all(feed: ChangeFeed) -> tuple[list[tuple[bool, object]], bool]:
    """Every change the feed holds now, and whether any read reported a gap."""
    changes: list[tuple[bool, object]] = []
    gap = False
    for _ in range(20):
        read = feed.read(0.05)
        changes += read.changes
        gap = gap or read.gap
        if not read.changes:
            break
    return changes, gap


def test_another_node_reads_stores_evictions_and_deletes_in_order(
    tmp_path: Path, redis_url: str
) -> None:
    root = str(tmp_path / "s")
    writer = FsStore(root, create=True, max_bytes=3 * SIZE, index=redis_url)
    reader = FsStore(root, index=redis_url)  # the second node: its own client
    assert writer.index is not None and reader.index is not None
    feed = reader.index.feed()
    try:
        for chunk in CHUNKS[:5]:
            assert writer.put(chunk.key, chunk.data)
        writer.index.flush()
        changes, gap = read_all(feed)
        assert not gap
        keys = [c.key for c in CHUNKS[:5]]
        assert [k for stored, k in changes if stored] == keys
        # the two oldest made room for the last two, each before the chunk that took it
        assert [k for stored, k in changes if not stored] == keys[:2]
        assert changes.index((False, keys[0])) < changes.index((True, keys[3]))
        assert final_state(changes) == {k: k not in keys[:2] for k in keys}
        writer.delete_many([keys[2]])
        changes, gap = read_all(feed)
        assert changes == [(False, keys[2])] and not gap
    finally:
        writer.close()
        reader.close()


def test_a_reconcile_announces_what_it_adds(tmp_path: Path, redis_url: str) -> None:
    root = str(tmp_path / "s")
    plain = FsStore(root, create=True)
    plain.put_many([(c.key, c.data) for c in CHUNKS[:3]])  # written with no index
    plain.close()
    store = FsStore(root, index=redis_url)
    assert store.index is not None
    feed = store.index.feed()
    try:
        store.index.reconcile()
        changes, _ = read_all(feed)
        assert final_state(changes) == {c.key: True for c in CHUNKS[:3]}
        store.index.reconcile()  # nothing new: nothing announced
        assert read_all(feed)[0] == []
    finally:
        store.close()


def test_a_trimmed_or_lost_stream_reads_as_a_gap(tmp_path: Path, redis_url: str) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    assert store.index is not None
    feed = store.index.feed()
    client = store.index.client
    try:
        store.put(CHUNKS[0].key, CHUNKS[0].data)
        store.index.flush()
        assert read_all(feed) == ([(True, CHUNKS[0].key)], False)
        # entries trimmed away before they were read
        for chunk in CHUNKS[1:4]:
            store.put(chunk.key, chunk.data)
        store.index.flush()
        client.xtrim(feed.key, maxlen=1, approximate=False)
        read = feed.read(0.05)
        assert read.gap
        assert not feed.read(0.05).gap  # read on from the stream's end
        # the stream gone (a flush, a server restarted with no persistence)
        client.delete(feed.key)
        assert feed.read(0.05).gap
        store.put(CHUNKS[5].key, CHUNKS[5].data)
        store.index.flush()
        assert read_all(feed) == ([(True, CHUNKS[5].key)], False)
        # gone and begun anew between two reads, with more entries than were read
        client.delete(feed.key)
        for chunk in CHUNKS[6:8]:
            store.put(chunk.key, chunk.data)
        store.index.flush()
        assert feed.read(0.05).gap
        assert read_all(feed) == ([], False)
    finally:
        store.close()


@pytest.mark.parametrize("opened", ["before the server went away", "while it was away"])
def test_a_feed_reports_a_gap_once_the_server_is_back(
    tmp_path: Path, private_redis: Callable[[], subprocess.Popen[bytes]], opened: str
) -> None:
    server = private_redis()
    url = f"redis://127.0.0.1:{private_redis.port}/0"  # type: ignore[attr-defined]
    store = FsStore(str(tmp_path / "s"), create=True, index=url)
    assert store.index is not None
    try:
        feed = store.index.feed() if opened.startswith("before") else None
        server.kill()
        server.wait()
        if feed is None:
            feed = store.index.feed()  # no exception: serve --events starts all the same
        else:
            read = feed.read(0.05)
            assert not read.changes and not read.gap
        assert feed.errors == 1
        private_redis()
        assert feed.read(0.05).gap
        assert not feed.read(0.05).gap
    finally:
        store.close()


def test_a_writer_that_loses_a_put_race_leaves_the_winner_counted(
    tmp_path: Path, redis_url: str
) -> None:
    """Two nodes reserve room for the same chunk; one publishes, the other finds the name
    taken. The loser must not take the winner's chunk out of the index (nor announce it
    gone), whichever accounts first."""
    root = str(tmp_path / "s")
    nodes = [FsStore(root, create=True, max_bytes=40 * SIZE, index=redis_url) for _ in range(2)]
    indexes = [n.index for n in nodes]
    assert indexes[0] is not None and indexes[1] is not None
    feed = indexes[0].feed()
    final = nodes[0].path_of(CHUNKS[0].key)
    try:
        loser = indexes[0].reserve(final, SIZE)
        winner = indexes[1].reserve(final, SIZE)
        assert loser.result() == winner.result() == SIZE  # drawn from each one's credit
        assert not indexes[0].admit(final, SIZE, lambda: False, replace=False, reserved=loser)
        indexes[0].flush()  # the loser's account first
        assert indexes[1].admit(final, SIZE, lambda: True, replace=False, reserved=winner)
        for index in indexes:
            index.flush()
        assert indexes[0].usage().chunks == 1
        name = nodes[0]._name_of(final)
        assert indexes[0].client.zscore(indexes[0]._keys[1], name) is not None
        assert final_state(read_all(feed)[0]) == {CHUNKS[0].key: True}
    finally:
        for node in nodes:
            node.close()


def _links(store: object, feed: ChangeFeed) -> dict[object, bytes | None]:
    """Per chunk the feed named stored: the parent and tokens (``d``) its entry carried."""
    changes: dict[object, bytes | None] = {}
    for _ in range(20):
        read = feed.read(0.05)
        for stored, key in read.changes:
            if stored:
                changes[key] = read.links.get(key)
        if not read.changes:
            break
    return changes


@pytest.mark.parametrize("capped", [False, True])
def test_a_filesystem_writers_entries_carry_what_each_key_hashes(
    tmp_path: Path, redis_url: str, capped: bool
) -> None:
    """A reader announces the chunk from its entry: BLAKE3 of ``d`` is the key's digest,
    and it is the header's parent and tokens. A reconcile's entry, from a walk, has none."""
    import blake3

    from chunkstore.format import read_header

    root = str(tmp_path / "s")
    writer = FsStore(root, create=True, max_bytes=100 * SIZE if capped else None, index=redis_url)
    assert writer.index is not None
    feed = writer.index.feed()
    try:
        writer.put_many([(c.key, c.data) for c in CHUNKS[:4]])
        writer.index.flush()
        links = _links(writer, feed)
        assert set(links) == {c.key for c in CHUNKS[:4]}
        for chunk in CHUNKS[:4]:
            link = links[chunk.key]
            assert link is not None and blake3.blake3(link).digest() == chunk.key.digest
            header = read_header(chunk.data)
            assert link == header.parent + header.token_bytes
        plain = FsStore(root)
        plain.put(CHUNKS[4].key, CHUNKS[4].data)
        plain.close()
        writer.index.reconcile()
        assert _links(writer, feed) == {CHUNKS[4].key: None}
    finally:
        writer.close()


def test_an_s3_writers_entries_carry_what_each_key_hashes(
    s3_endpoint: str, s3_bucket: str, redis_url: str
) -> None:
    import blake3

    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    store = S3Store(s3_bucket, "linked", endpoint_url=s3_endpoint, backoff=0.001, index=redis_url)
    assert store.index is not None
    feed = store.index.feed()
    try:
        store.put_many([(c.key, c.data) for c in CHUNKS[:3]])
        links = _links(store, feed)
        assert set(links) == {c.key for c in CHUNKS[:3]}
        assert all(
            link is not None and blake3.blake3(link).digest() == key.digest
            for key, link in links.items()
        )
    finally:
        store.close()
