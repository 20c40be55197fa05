"""Every policy makes exactly the recorded decisions on seeded workloads (policy_decisions.py).

The digests pin each decision of ``parc``, ARC and LRU (hits, victims in order,
refusals, ``evict()``/``remove()`` answers, final lists) so that a change meant to
make a policy faster cannot change what it does. How they were recorded, and how
to refresh them after a deliberate behaviour change: see
:mod:`tests.cache.policy_decisions`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cache import policy_decisions as decisions

RECORDED: dict[str, Any] = json.loads(decisions.VECTORS.read_text(encoding="utf-8"))
STREAMS = dict(decisions.streams())
COMPARED = ("digest", "lookups", "hits", "evictions", "refusals")
"""Fields that must match (``vetoes`` counts ``can_evict`` calls, which a policy may save)."""


def test_the_vectors_cover_every_stream_policy_and_driver() -> None:
    expected = {
        f"{name}/{capacity}/{policy}/{driver}"
        for name, stream in STREAMS.items()
        for capacity in decisions.capacities(stream)
        for policy in decisions.POLICIES
        for driver in decisions.DRIVERS
    }
    assert set(RECORDED["cases"]) == expected
    assert len(expected) == 6 * 3 * 4 * 2


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_streams_are_the_recorded_ones(name: str) -> None:
    # A mismatch here means the trace generator changed, not a policy.
    assert decisions.stream_digest(STREAMS[name]) == RECORDED["input"][name]


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_decisions_match_the_recorded_digests(name: str) -> None:
    stream = STREAMS[name]
    differing = []
    for capacity in decisions.capacities(stream):
        for policy, make in decisions.POLICIES.items():
            for driver, replay in decisions.REPLAYS.items():
                case = f"{name}/{capacity}/{policy}/{driver}"
                log = replay(make(capacity), stream).to_json()
                recorded = RECORDED["cases"][case]
                if any(log[field] != recorded[field] for field in COMPARED):
                    differing.append(f"{case}: {log} != recorded {recorded}")
    assert not differing, "\n".join(differing)


def test_the_streams_exercise_pins_refusals_and_idle_expiry() -> None:
    # Without these the digests would not cover the paths a speed-up is most likely to break.
    cases = RECORDED["cases"]
    for policy in ("parc", "arc", "lru"):
        admits = [v for k, v in cases.items() if k.endswith(f"/{policy}/admit")]
        assert any(v["vetoes"] for v in admits) and any(v["refusals"] for v in admits)
    expired = [
        key
        for key, value in cases.items()
        if "/parc/" in key
        and value["digest"] != cases[key.replace("/parc/", "/parc-no-expiry/")]["digest"]
    ]
    assert any(k.endswith("/access") for k in expired)
    assert any(k.endswith("/admit") for k in expired)
