"""ARC on request streams traced by hand from Megiddo & Modha (FAST 2003), Fig. 4.

Each step lists (request, hit?, evicted, T1, T2, B1, B2, p) after serving the
request, with lists written LRU first. The comment above each step is the
hand derivation: which case of the paper applies and what REPLACE does
(REPLACE(x, p) evicts T1's LRU into B1 when |T1| >= 1 and (|T1| > p or
(x in B2 and |T1| == p)); otherwise T2's LRU into B2).
"""

from __future__ import annotations

from chunkstore.cache import ARCPolicy

Step = tuple[int, bool, "int | None", list[int], list[int], list[int], list[int], float]


def run(capacity: int, steps: list[Step]) -> None:
    policy = ARCPolicy(capacity)
    for number, (x, hit, evicted, t1, t2, b1, b2, p) in enumerate(steps, start=1):
        if policy.hit(x):
            got_hit, got_evicted = True, None
        else:
            got_hit, got_evicted = False, policy.admit(x)
        state = (
            got_hit,
            got_evicted,
            list(policy.t1),
            list(policy.t2),
            list(policy.b1),
            list(policy.b2),
            policy.p,
        )
        assert state == (hit, evicted, t1, t2, b1, b2, p), f"step {number} (request {x})"


def test_ghost_hits_move_p_both_ways() -> None:
    # c = 2, p = 0.
    run(
        2,
        [
            # IV.B: |L1| = 0 < c, total 0 < c: no REPLACE; 1 -> T1.
            (1, False, None, [1], [], [], [], 0.0),
            # IV.B: |L1| = 1 < c, total 1 < c.
            (2, False, None, [1, 2], [], [], [], 0.0),
            # IV.A: |L1| = 2 = c and |T1| = c: delete T1's LRU (1) outright, no ghost.
            (3, False, 1, [2, 3], [], [], [], 0.0),
            # IV.A again: 1 is in no list (it left without a ghost); 2 goes the same way.
            (1, False, 2, [3, 1], [], [], [], 0.0),
            # Case I: hit in T1 -> MRU of T2.
            (1, True, None, [3], [1], [], [], 0.0),
            # IV.B: |L1| = 1 < c, total 2 >= c, total != 2c: REPLACE(4, 0): |T1| = 1 > 0 -> 3 to B1.
            (4, False, 3, [4], [1], [3], [], 0.0),
            # Case II (3 in B1): |B1| >= |B2| so delta 1, p = 1. REPLACE(3, 1): |T1| = 1 is not > 1
            # and 3 is not in B2 -> T2's LRU (1) to B2. 3 -> MRU of T2.
            (3, False, 1, [4], [3], [], [1], 1.0),
            # Case III (1 in B2): |B2| >= |B1| so delta 1, p = 0.
            # REPLACE(1, 0): |T1| = 1 > 0 -> 4 to B1.
            (1, False, 4, [], [3, 1], [4], [], 0.0),
            # IV.B: |L1| = 1, total 3 != 4. REPLACE(5, 0): T1 empty -> T2's LRU (3) to B2.
            (5, False, 3, [5], [1], [4], [3], 0.0),
            # IV.A: |L1| = 2 = c, |T1| = 1 < c: delete B1's LRU (4); REPLACE(6, 0): 5 to B1.
            (6, False, 5, [6], [1], [5], [3], 0.0),
            # 4 is a ghost no more: IV.A again, delete B1's LRU (5); REPLACE(4, 0): 6 to B1.
            (4, False, 6, [4], [1], [6], [3], 0.0),
            # Case III (3 in B2): |B2| = |B1| so delta 1, p = max(-1, 0) = 0.
            # REPLACE(3, 0): |T1| = 1 > 0 -> 4 to B1; 3 -> MRU of T2.
            (3, False, 4, [], [1, 3], [6, 4], [], 0.0),
            # IV.A: |L1| = 2 = c, |T1| = 0 < c: delete B1's LRU (6);
            # REPLACE(7, 0): T1 empty -> 1 to B2.
            (7, False, 1, [7], [3], [4], [1], 0.0),
        ],
    )


def test_replace_tie_rule_and_large_delta() -> None:
    # c = 3, p = 0. Make 1, 2, 3 frequent first.
    run(
        3,
        [
            (1, False, None, [1], [], [], [], 0.0),
            (2, False, None, [1, 2], [], [], [], 0.0),
            (3, False, None, [1, 2, 3], [], [], [], 0.0),
            (1, True, None, [2, 3], [1], [], [], 0.0),
            (2, True, None, [3], [1, 2], [], [], 0.0),
            (3, True, None, [], [1, 2, 3], [], [], 0.0),
            # IV.B: |L1| = 0, total 3 >= c. REPLACE(4, 0): T1 empty -> T2's LRU (1) to B2.
            (4, False, 1, [4], [2, 3], [], [1], 0.0),
            # IV.B: |L1| = 1, total 4. REPLACE(5, 0): |T1| = 1 > 0 -> 4 to B1.
            (5, False, 4, [5], [2, 3], [4], [1], 0.0),
            # IV.B: |L1| = 2, total 5. REPLACE(6, 0): 5 to B1.
            (6, False, 5, [6], [2, 3], [4, 5], [1], 0.0),
            # Case II (4 in B1): |B1| = 2 >= |B2| = 1, delta 1, p = 1.
            # REPLACE(4, 1): |T1| = 1 is not > 1 -> T2's LRU (2) to B2.
            (4, False, 2, [6], [3, 4], [5], [1, 2], 1.0),
            # Case II (5 in B1): |B1| = 1 < |B2| = 2, delta = 2/1, p = min(3, 3) = 3.
            # REPLACE(5, 3): |T1| = 1 is not > 3 -> 3 to B2.
            (5, False, 3, [6], [4, 5], [], [1, 2, 3], 3.0),
            # IV.B: |L1| = 1, total 6 = 2c: delete B2's LRU (1). REPLACE(7, 3): 4 to B2.
            (7, False, 4, [6, 7], [5], [], [2, 3, 4], 3.0),
            # Case III (2 in B2): |B2| = 3 >= |B1| = 0, delta 1, p = 2. REPLACE(2, 2): |T1| = 2 is
            # not > 2, but 2 is in B2 and |T1| == p -> T1's LRU (6) to B1 (the tie rule).
            (2, False, 6, [7], [5, 2], [6], [3, 4], 2.0),
            # IV.B: |L1| = 2, total 6 = 2c: delete B2's LRU (3). REPLACE(8, 2): |T1| = 1 -> 5 to B2.
            (8, False, 5, [7, 8], [2], [6], [4, 5], 2.0),
            # Case II (6 in B1): |B1| = 1 < |B2| = 2, delta 2, p = min(4, 3) = 3 (clamped at c).
            # REPLACE(6, 3): |T1| = 2 is not > 3 -> 2 to B2.
            (6, False, 2, [7, 8], [6], [], [4, 5, 2], 3.0),
        ],
    )


def test_fractional_adaptation() -> None:
    # c = 5, p = 0: a ghost hit in B1 while |B2| = 3 > |B1| = 2 moves p by 3/2.
    run(
        5,
        [
            (1, False, None, [1], [], [], [], 0.0),
            (1, True, None, [], [1], [], [], 0.0),
            (13, False, None, [13], [1], [], [], 0.0),
            (4, False, None, [13, 4], [1], [], [], 0.0),
            (4, True, None, [13], [1, 4], [], [], 0.0),
            (9, False, None, [13, 9], [1, 4], [], [], 0.0),
            (5, False, None, [13, 9, 5], [1, 4], [], [], 0.0),
            # IV.B: |L1| = 3, total 5 >= c. REPLACE(11, 0): |T1| = 3 > 0 -> 13 to B1.
            (11, False, 13, [9, 5, 11], [1, 4], [13], [], 0.0),
            # Case II: delta 1, p = 1. REPLACE(13, 1): |T1| = 3 > 1 -> 9 to B1. 13 -> T2.
            (13, False, 9, [5, 11], [1, 4, 13], [9], [], 1.0),
            # IV.B: |L1| = 3, total 6. REPLACE(8, 1): |T1| = 2 > 1 -> 5 to B1.
            (8, False, 5, [11, 8], [1, 4, 13], [9, 5], [], 1.0),
            (8, True, None, [11], [1, 4, 13, 8], [9, 5], [], 1.0),
            # IV.B: |L1| = 3, total 7. REPLACE(2, 1): |T1| = 1 is not > 1 -> T2's LRU (1) to B2.
            (2, False, 1, [11, 2], [4, 13, 8], [9, 5], [1], 1.0),
            # Case II (5 in B1): |B1| = 2 >= |B2| = 1, delta 1, p = 2. REPLACE(5, 2): 4 to B2.
            (5, False, 4, [11, 2], [13, 8, 5], [9], [1, 4], 2.0),
            # IV.B: |L1| = 3, total 8. REPLACE(7, 2): |T1| = 2 is not > 2 -> 13 to B2.
            (7, False, 13, [11, 2, 7], [8, 5], [9], [1, 4, 13], 2.0),
            # IV.B: |L1| = 4, total 9. REPLACE(10, 2): |T1| = 3 > 2 -> 11 to B1.
            (10, False, 11, [2, 7, 10], [8, 5], [9, 11], [1, 4, 13], 2.0),
            # Case II (9 in B1): |B1| = 2 < |B2| = 3, delta = 3/2, p = 3.5.
            # REPLACE(9, 3.5): |T1| = 3 is not > 3.5 -> T2's LRU (8) to B2.
            (9, False, 8, [2, 7, 10], [5, 9], [11], [1, 4, 13, 8], 3.5),
        ],
    )


def test_pinned_victim_is_skipped_within_its_list() -> None:
    # c = 2: T1 = [1, 2]; REPLACE would drop 1 (IV.A, |T1| = c), but 1 is pinned: 2 goes.
    policy = ARCPolicy(2)
    policy.admit(1)
    policy.admit(2)
    assert policy.admit(3, lambda k: k != 1) == 2
    assert list(policy.t1) == [1, 3]


def test_pinned_list_falls_back_to_the_other_list() -> None:
    # c = 2, T1 = [3], T2 = [1]; p = 0 so REPLACE prefers T1's 3, which is pinned: 1 goes to B2.
    policy = ARCPolicy(2)
    for x in (1, 1, 3):
        policy.access(x)
    assert (list(policy.t1), list(policy.t2)) == ([3], [1])
    assert policy.admit(4, lambda k: k != 3) == 1
    assert (list(policy.t1), list(policy.t2), list(policy.b2)) == ([3, 4], [], [1])
