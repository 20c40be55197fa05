"""ARC written line by line from Megiddo & Modha (FAST 2003), Fig. 4, with plain lists.

Deliberately naive (O(n) list operations, no pins, no deletions) so that it is
easy to check against the paper; the real :class:`ARCPolicy` is compared with
it by a Hypothesis state machine. Lists are LRU first, MRU last.
"""

from __future__ import annotations


class PaperARC:
    def __init__(self, c: int) -> None:
        self.c = c
        self.p = 0.0
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []

    def request(self, x: int) -> bool:
        """Serve one request; True on a cache hit."""
        c = self.c
        # Case I: x in T1 or T2 -> MRU of T2.
        if x in self.t1 or x in self.t2:
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
            return True
        # Case II: x in B1.
        if x in self.b1:
            d1 = 1 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(self.p + d1, c)
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
            return False
        # Case III: x in B2.
        if x in self.b2:
            d2 = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(self.p - d2, 0)
            self.replace(x)
            self.b2.remove(x)
            self.t2.append(x)
            return False
        # Case IV: x in none of the lists.
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 == c:  # Case A
            if len(self.t1) < c:
                self.b1.pop(0)
                self.replace(x)
            else:
                self.t1.pop(0)
        elif l1 < c and total >= c:  # Case B
            if total == 2 * c:
                self.b2.pop(0)
            self.replace(x)
        self.t1.append(x)
        return False

    def replace(self, x: int) -> None:
        t1 = len(self.t1)
        if t1 >= 1 and (t1 > self.p or (x in self.b2 and t1 == self.p)):
            self.b1.append(self.t1.pop(0))
        else:
            self.b2.append(self.t2.pop(0))
