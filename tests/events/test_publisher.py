"""EventPublisher -> EventSubscriber -> PrefixIndex: stores, removals, restarts, reconnects."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")

from chunkstore.events import (  # noqa: E402
    EventBatch,
    EventPublisher,
    EventSubscriber,
    PrefixIndex,
    all_blocks_cleared,
    block_removed,
    block_stored,
)

ROUNDS = 100
"""Most reads of 0.1 s a test waits for batches to arrive (bounded, never a timing check)."""


@pytest.fixture
def ends(tmp_path):
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


def stored(*hashes, medium="STORAGE"):
    return EventBatch(0.0, [block_stored(list(hashes), None, [0] * 16, 16, medium)])


def removed(*hashes, medium="STORAGE"):
    return EventBatch(0.0, [block_removed(list(hashes), medium)])


def read_until(sub, index, want, source="store"):
    """Apply batches to ``index`` until one with sequence number ``want`` was read."""
    got = []
    for _ in range(ROUNDS):
        for received in sub.receive(timeout=0.1):
            index.apply(source, received)
            got.append(received.seq)
        if got and got[-1] >= want:
            return got
    raise AssertionError(f"batch {want} never arrived (got {got})")


def joined(pub, sub, index):
    """Publish markers until the subscriber sees one (PUB drops batches sent before a SUB
    is connected); returns the marker's sequence number."""
    for _ in range(ROUNDS):
        pub.publish(EventBatch(0.0, []))
        received = sub.receive(timeout=0.1)
        for r in received:
            index.apply("store", r)
        if received:
            return received[-1].seq
    raise AssertionError("subscriber never joined")


def test_stores_and_removals_make_the_index_answer_longest_prefix(ends):
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            index = PrefixIndex()
            joined(pub, sub, index)
            pub.publish(stored(1, 2, 3))
            pub.publish(stored(1, 2, medium="CPU"))
            pub.publish(removed(3))
            pub.flush()
            read_until(sub, index, pub.sent - 1)
            assert index.longest_prefix([1, 2, 3, 4]) == [
                (2, "store", "CPU"),
                (2, "store", "STORAGE"),
            ]
            assert index.longest_prefix([9]) == []
            assert sub.lost == 0


def test_a_reconnected_subscriber_replays_what_it_missed(ends):
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            index = PrefixIndex()
            joined(pub, sub, index)
            sub._sub.close(0)  # the subscriber drops off...
            for h in range(10, 20):
                pub.publish(stored(h))
            pub.flush()
            sub.connect()  # ...and comes back: the next live batch shows the gap
            joined(pub, sub, index)
            assert sub.replayed >= 10 and sub.lost == 0
            assert index.count("store", "STORAGE") == 10


def test_a_gap_beyond_the_replay_buffer_is_counted_lost(ends):
    with EventPublisher(ends[0], replay_endpoint=ends[1], buffer_steps=3) as pub:
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            index = PrefixIndex()
            first = joined(pub, sub, index)
            sub._sub.close(0)
            for h in range(10):
                pub.publish(stored(h))
            pub.flush()
            sub.connect()
            last = joined(pub, sub, index)
            # Batches first+1 .. last-1 were missed live; the buffer kept the last 3 sent.
            missed = last - first - 1
            assert sub.lost == missed - 2 and sub.replayed == 2


def test_a_restarted_publisher_is_seen_and_its_old_blocks_forgotten(ends):
    index = PrefixIndex()
    with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            joined(pub, sub, index)
            for _ in range(5):
                pub.publish(stored(1, 2))
            pub.flush()
            read_until(sub, index, pub.sent - 1)
        assert index.count("store", "STORAGE") == 2
        got = []
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            # What a new chunkstore publisher sends first, until the subscriber has joined.
            for _ in range(ROUNDS):
                pub.publish(EventBatch(0.0, [all_blocks_cleared()]))
                got.extend(sub.receive(timeout=0.1))
                if got:
                    break
            pub.publish(stored(5))
            for _ in range(ROUNDS):
                got.extend(sub.receive(timeout=0.1))
                if any(e["type"] == "BlockStored" for r in got for e in r.batch.events):
                    break
    for received in got:
        index.apply("store", received)
    assert sub.restarts == 1
    assert index.longest_prefix([1, 2]) == [] and index.count("store", "STORAGE") == 1


def test_a_late_subscriber_catches_up_from_the_replay_buffer(ends):
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        for h in range(5):
            pub.publish(stored(h))
        pub.flush()
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            index = PrefixIndex()
            for received in sub.catch_up():
                index.apply("store", received)
            assert [h for h in range(5) if index.longest_prefix([h])] == list(range(5))
            joined(pub, sub, index)  # the live batches after it are not a restart
            assert sub.restarts == 0 and sub.lost == 0


def test_publish_after_close_is_refused(ends):
    pub = EventPublisher(ends[0])
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish(EventBatch(0.0, []))


def test_a_restart_hidden_behind_a_gap_is_told_by_replay(ends):
    index = PrefixIndex()
    with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            joined(pub, sub, index)
            for _ in range(3):
                pub.publish(stored(1, 2))
            pub.flush()
            read_until(sub, index, pub.sent - 1)
        seen = sub.expected
        sub._sub.close(0)
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            for h in range(seen + 5):  # more batches than the first publisher sent
                pub.publish(stored(100 + h))
            pub.flush()
            sub.connect()
            joined(pub, sub, index)  # a live batch past the gap
    assert sub.restarts == 1 and sub.lost == 0
    assert index.longest_prefix([1]) == []
    assert index.count("store", "STORAGE") == seen + 5


def test_a_restarted_publisher_with_fewer_batches_is_told_by_replay(ends):
    index = PrefixIndex()
    with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            joined(pub, sub, index)
            for _ in range(5):
                pub.publish(stored(1, 2))
            pub.flush()
            read_until(sub, index, pub.sent - 1)
        sub._sub.close(0)
        # The new publisher's batches were all sent while the subscriber was away: no live
        # batch tells it, and the replay has nothing from where it stopped.
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            pub.publish(EventBatch(0.0, [all_blocks_cleared()]))
            pub.publish(stored(7))
            pub.flush()
            sub.connect()
            for received in sub.catch_up():
                index.apply("store", received)
    assert sub.restarts == 1 and sub.lost == 0
    assert index.longest_prefix([1]) == []
    assert index.longest_prefix([7]) == [(1, "store", "STORAGE")]
