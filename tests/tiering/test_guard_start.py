"""GuardedTier.start: a guarded call begun now and settled later, judged as ``call`` is.

Calls are held by events, never by sleeps: each test takes the same path on a slow machine.
"""

from __future__ import annotations

import threading

import pytest

from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.tiering._guard import GuardedTier, TierUnavailable
from tests.tiering.doubles import GatedStore


def _guarded(store: GatedStore, metrics: ChunkstoreMetrics, **options: object) -> GuardedTier:
    options = {"timeout": 30.0, "retry_after": 3600.0, **options}
    return GuardedTier(store, metrics.tier(store.name), **options)  # type: ignore[arg-type]


def test_a_started_call_runs_while_the_caller_goes_on(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    store = GatedStore("disk")
    tier = _guarded(store, metrics, workers=2, start_workers=True)
    try:
        items = [(chain[0].key, chain[0].data)]
        call = tier.start("put", store.put_many, items)
        assert store.entered.wait(timeout=30)  # running on the tier's thread, not finished
        assert not call.future.done()
        store.gate.set()
        assert call.result() == [True]
        assert store.get(chain[0].key) == chain[0].data
    finally:
        store.gate.set()
        tier.close()


def test_a_started_call_past_its_deadline_is_unavailable_and_still_pending(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    store = GatedStore("disk")
    tier = _guarded(store, metrics, timeout=0.05)
    try:
        call = tier.start("put", store.put_many, [(chain[0].key, chain[0].data)])
        with pytest.raises(TierUnavailable) as raised:
            call.result()
        assert raised.value.pending is call.future  # still running: its input is in use
        assert not tier.writable and not tier.up  # it did not answer: down for both
        with pytest.raises(TierUnavailable) as refused:
            tier.start("put", store.put_many, [(chain[1].key, chain[1].data)])
        assert refused.value.pending is None  # in back-off: refused at once, nothing started
    finally:
        store.gate.set()
        tier.close()
    assert store.finished.wait(timeout=30)


def test_without_a_timeout_a_started_call_has_already_run(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    store = GatedStore("disk")
    store.gate.set()
    tier = _guarded(store, metrics, timeout=None)
    caller = threading.get_ident()
    ran_on: list[int] = []

    def put(items: list[tuple[object, bytes]]) -> list[bool]:
        ran_on.append(threading.get_ident())
        raise OSError("disk gone")

    call = tier.start("put", put, [(chain[0].key, chain[0].data)])
    assert call.future.done() and ran_on == [caller]
    with pytest.raises(TierUnavailable):
        call.result()  # the failure is judged when the result is taken, as call() does
    assert not tier.writable


def test_a_started_calls_duration_ends_when_the_call_does_not_when_it_is_taken(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    store = GatedStore("disk")
    tier = _guarded(store, metrics, workers=1)
    try:
        call = tier.start("put", store.put_many, [(chain[0].key, chain[0].data)])
        callbacks_ran = threading.Event()  # done callbacks run in order: the call's own first
        call.future.add_done_callback(lambda _future: callbacks_ran.set())
        assert store.entered.wait(timeout=30)
        running = call.seconds()
        assert call.seconds() >= running > 0  # still running: the clock goes on
        store.gate.set()
        assert call.result() == [True]
        assert callbacks_ran.wait(timeout=30)
        ended = call.seconds()
        assert ended >= running
        threading.Event().wait(0.01)  # the caller busy elsewhere before it reads the duration
        assert call.seconds() == ended  # fixed at the call's end, whenever it is read
    finally:
        store.gate.set()
        tier.close()


# --- hand_off: begun under the guard, waited for by nobody ------------------------------------


def test_a_handed_off_call_runs_on_the_tier_while_the_caller_goes_on(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    store = GatedStore("disk")
    tier = _guarded(store, metrics, workers=1)
    try:
        assert tier.hand_off("put", store.put_many, [(chain[0].key, chain[0].data)]) is None
        assert store.entered.wait(timeout=30)  # running on the tier's thread...
        assert not store.finished.is_set()  # ...stalled, and the caller already back
        store.gate.set()
        assert store.finished.wait(timeout=30)
        assert store.get(chain[0].key) == chain[0].data
    finally:
        store.gate.set()
        tier.close()


def test_a_handed_off_call_is_not_made_while_the_tier_is_in_back_off(
    metrics: ChunkstoreMetrics,
) -> None:
    store = GatedStore("disk")
    store.gate.set()
    tier = _guarded(store, metrics)
    made: list[str] = []
    try:
        with pytest.raises(TierUnavailable):
            tier.call("delete", _raise, OSError("disk gone"))
        assert tier.hand_off("delete", made.append, "set aside") == "tier disk is in back-off"
        assert made == []
    finally:
        tier.close()
    closed = _guarded(store, metrics)
    closed.close()
    assert closed.hand_off("delete", made.append, "set aside") == "tier disk is closed"
    assert made == []


def test_a_handed_off_failure_is_judged_not_raised(
    metrics: ChunkstoreMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    store = GatedStore("disk")
    tier = _guarded(store, metrics, timeout=None)  # runs here: judged before hand_off returns
    with caplog.at_level("WARNING"):
        assert tier.hand_off("delete", _raise, OSError("disk gone")) is None
    assert not tier.up and not tier.writable  # backed off, as a waited-for call would be
    assert "tier disk: delete OSError: disk gone" in caplog.text


def _raise(exc: Exception) -> None:
    raise exc
