"""O_DIRECT chunk files from huge-page buffers vs 4 KiB-page buffers, on this machine's disk.

What ``ChunkStoreTier`` gains by staging chunks in huge-page buffers
(:mod:`chunkstore.tiering._buffers`), measured without any tier: ``--files`` new
files of one 2 MiB chunk each (a 4 KiB header page + the payload, as chunk format v1
lays it out) are written with ``O_DIRECT`` (temp name, then rename) and read back with
``O_DIRECT``, ``--threads`` at a time, from three kinds of buffer:

* ``shared``: one shared anonymous region, 4 KiB pages (what vLLM's fs tier transfers
  from: its primary region);
* ``4k``: private populated buffers, 4 KiB pages (the tier's buffers without huge pages);
* ``huge``: the tier's own :class:`ChunkBuffers`, payload on a huge-page boundary.

Also printed: the physically contiguous runs ("segments") per buffer, read from
``/proc/self/pagemap`` where this process may (root), since a device request holds a
bounded number of segments (``/sys/block/<dev>/queue/max_segments``). The kinds take
turns for ``--rounds`` rounds; ratios are huge / 4k and huge / shared per round. Numbers,
never a pass/fail threshold.

    python tools/bench_direct_io.py [--files 128] [--rounds 5] [--threads 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunkstore._hugepages import huge_page_size  # noqa: E402
from chunkstore.tiering import ChunkBuffers  # noqa: E402

HEADER = 4096
PAYLOAD = 2 << 20
CHUNK = HEADER + PAYLOAD
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _segments(view: memoryview) -> int | None:
    """Physically contiguous runs under ``view`` (None where pagemap shows no frames)."""
    pages = len(view) // mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(_address(view) // mmap.PAGESIZE * 8)
            raw = pagemap.read(8 * pages)
    except OSError:
        return None
    frames = [struct.unpack_from("<Q", raw, 8 * i)[0] & ((1 << 55) - 1) for i in range(pages)]
    if not any(frames):
        return None  # not root: the kernel hides frame numbers
    return 1 + sum(1 for a, b in zip(frames, frames[1:]) if b != a + 1)


def _buffers(count: int) -> dict[str, list[memoryview]]:
    region = mmap.mmap(-1, count * CHUNK)  # shared, like vLLM's primary region
    private = [
        memoryview(mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)))
        for _ in range(count)
    ]
    pool = ChunkBuffers(CHUNK, keep=count, huge_at=HEADER)
    kinds = {
        "shared": [memoryview(region)[i * CHUNK : (i + 1) * CHUNK] for i in range(count)],
        "4k": private,
        "huge": [view[:CHUNK] for view in pool.take(count)],
    }
    for views in kinds.values():
        for view in views:
            view[:] = os.urandom(CHUNK)
    return kinds


def _write(path: str, view: memoryview) -> None:
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
    try:
        os.write(fd, view)
    finally:
        os.close(fd)
    os.rename(path + ".tmp", path)


def _read(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | O_DIRECT)
    try:
        if os.readv(fd, [view]) != len(view):
            raise OSError(f"short read of {path}")
    finally:
        os.close(fd)


def _timed(pool: ThreadPoolExecutor, step: Callable[[str, memoryview], None], jobs: list) -> float:
    os.sync()  # no other phase's dirty pages written out during this one
    t0 = time.perf_counter()
    list(pool.map(lambda job: step(*job), jobs))
    return len(jobs) * CHUNK / (time.perf_counter() - t0) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=128, help="chunk files per phase")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the kinds taking turns")
    parser.add_argument("--threads", type=int, default=8, help="transfers in flight")
    parser.add_argument("--dir", default=None, help="directory to write under (default: temp)")
    args = parser.parse_args()
    if not O_DIRECT:
        print("skipped: no O_DIRECT on this system")
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-direct-io-", dir=args.dir))
    try:
        probe = work / "probe"
        try:
            _write(str(probe), memoryview(mmap.mmap(-1, mmap.PAGESIZE)))
        except OSError as exc:
            print(f"skipped: {work} refuses O_DIRECT ({exc.strerror})")
            return 0
        in_flight = min(args.threads, args.files)
        kinds = _buffers(in_flight)
        huge = huge_page_size()
        print(
            f"{args.files} files of {CHUNK} bytes, {args.threads} threads, {args.rounds} rounds, "
            f"huge pages: {f'{huge >> 20} MiB' if huge else 'none (THP off)'}, directory {work}"
        )
        for name, views in kinds.items():
            runs = [_segments(view) for view in views]
            known = [r for r in runs if r is not None]
            shown = f"{statistics.median(known):.0f}" if known else "unknown (needs root)"
            print(f"{name:>6}: physically contiguous runs per chunk buffer: {shown}")
        figures = {name: {"write": [], "read": []} for name in kinds}
        names = list(kinds)
        with ThreadPoolExecutor(args.threads) as pool:
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    folder = work / f"{name}-{r}"
                    folder.mkdir()
                    views = kinds[name]
                    jobs = [
                        (str(folder / f"c{i}"), views[i % in_flight]) for i in range(args.files)
                    ]
                    figures[name]["write"].append(_timed(pool, _write, jobs))
                    figures[name]["read"].append(_timed(pool, _read, jobs))
                    shutil.rmtree(folder)
        for name in names:
            w, rd = figures[name]["write"], figures[name]["read"]
            print(
                f"{name:>6}: write {statistics.median(w):.2f} GB/s, "
                f"read {statistics.median(rd):.2f} GB/s (medians)"
            )
        for base in ("4k", "shared"):
            for phase in ("write", "read"):
                ratios = [h / b for h, b in zip(figures["huge"][phase], figures[base][phase])]
                print(
                    f"huge / {base} {phase}: median {statistics.median(ratios):.2f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) per round"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
