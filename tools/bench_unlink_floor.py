"""The floor under a prune pass: bare ``os.unlink`` of 1 % of N small files, no chunkstore code.

    .venv/bin/python tools/bench_unlink_floor.py                      # 10^5, what `make bench` runs
    .venv/bin/python tools/bench_unlink_floor.py 1000000 /tmp/floor   # the 10^6 of the bench

Makes N 64-byte files in the store's fan-out (``<ns>/<ab>/<cd>/<hex>.kvc``, the names
``tools/bench_sharing.py`` gives its prune stores), then deletes three disjoint random 1 %
samples: one thread, 4 threads, 16 threads; and a fourth the way a store's eviction deletes
one chunk (stat, unlink, unlink of an access record that is not there), on one thread.
Removes the directory at the end.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def make(root: str, count: int) -> list[str]:
    paths = []
    made: set[str] = set()
    for i in range(count):
        hexkey = uuid.UUID(int=i * 0x9E3779B97F4A7C15 % (1 << 128)).hex * 2
        leaf = os.path.join(root, "0123456789abcdef", hexkey[:2], hexkey[2:4])
        if leaf not in made:
            os.makedirs(leaf, exist_ok=True)
            made.add(leaf)
        path = os.path.join(leaf, f"{hexkey}.kvc")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x" * 64)
        os.close(fd)
        paths.append(path)
    return paths


def as_evicted(path: str) -> None:
    os.stat(path)
    os.unlink(path)
    try:
        os.unlink(path + ".atime")
    except FileNotFoundError:
        pass


def timed(label: str, paths: list[str], fn: Callable[[str], None], threads: int) -> None:
    start = time.perf_counter()
    if threads == 1:
        for path in paths:
            fn(path)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, paths, chunksize=64))
    took = time.perf_counter() - start
    print(f"{label:<32} {len(paths):>7} in {took:7.3f} s ({took / len(paths) * 1e6:6.0f} us each)")


def main() -> int:
    if len(sys.argv) > 3 or (len(sys.argv) > 1 and not sys.argv[1].isdigit()):
        print("usage: bench_unlink_floor.py [COUNT [DIR]]  (default 100000, a new temp dir)")
        return 2
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    root = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="unlink-floor-")
    if os.path.isdir(root) and os.listdir(root) or os.path.exists(root) and not os.path.isdir(root):
        # It is removed at the end: never a directory that holds anything already.
        print(f"bench_unlink_floor.py: {root} exists and is not an empty directory")
        return 2
    start = time.perf_counter()
    paths = make(root, count)
    print(f"made {count} files in {time.perf_counter() - start:.1f} s", flush=True)
    part = count // 100
    sample = random.Random(1).sample(paths, 4 * part)
    try:
        timed("unlink, 1 thread", sample[:part], os.unlink, 1)
        timed("unlink, 4 threads", sample[part : 2 * part], os.unlink, 4)
        timed("unlink, 16 threads", sample[2 * part : 3 * part], os.unlink, 16)
        timed("stat + unlink + unlink(.atime)", sample[3 * part :], as_evicted, 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
