"""Store benchmark: FsStore and S3Store against raw reads/writes of the same bytes, in one run.

Filesystem, warm page cache (nothing hides the checksum), 256-token chunks of
2 MiB and 32 MiB:

* get (verified) vs a raw unbuffered ``readinto`` of the same file into a
  preallocated buffer; both ``get`` (new bytes per call) and ``get_into`` (a
  reused buffer, the host-pool path) are reported;
* get without verification (``verify=False``, host-trusted path);
* ``get_many_into`` into the slots of a host-cache pool (``SlotPool``: page-aligned, on
  huge pages where the kernel has them), the prefetch path: several reads in flight on
  the store's ``io_workers`` threads, verified and not, against the same serial raw reads;
  verified with 2, 4, 8 and one ``io_workers`` per core (``--workers``), warm and cold (every
  file dropped from the page cache with ``posix_fadvise(DONTNEED)`` before each pass, checked
  with ``mincore``; cold rows against one thread's plain reads of the same cold files);
* put vs a raw write + rename of the same bytes, one at a time and as one ``put_many``; and
  ``put_many`` with ``write_mode="direct"`` from host-pool slots (the write-back path of a
  tiered store: ``O_DIRECT`` straight from the slots) against the same raw writes;
* the floor of any verified read, with no chunkstore code at all: the raw read in 256 KiB
  ``preadv`` blocks, each hashed (XXH3-128, the format's checksum) right after it lands,
  and the same hash over a read-only ``mmap`` of the file (no copy at all) — what a
  verified read costs against a bare copy whatever language does it.

S3 on a local moto server: ``get_many``/``put_many`` vs raw s3fs ``cat``/``pipe``,
for the s3fs data path and, where NIXL is installed, ``data_path="nixl"`` (NIXL's
OBJ backend; its reads add a HEAD per chunk over s3fs).

Counts are small (about 128-256 MiB per measurement, best of a few passes) so
the whole run stays well under a minute; ratios, not absolute numbers, are the
point. Never fails on a threshold.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import mmap
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import xxhash

from chunkstore.backends._fastread import BLOCK
from chunkstore.backends._fs import FsStore
from chunkstore.cache import SlotPool
from chunkstore.errors import ChunkStoreError
from chunkstore.format import ChunkLayout, KVSpec
from chunkstore.testing.factories import MadeChunk, sample_chunks

# 256 tokens x 2 (K,V) x layers x heads x head_dim x 2 bytes (BF16)
SHAPES = {
    "2MiB": dict(num_layers=4, num_kv_heads=4, head_dim=128),
    "32MiB": dict(num_layers=32, num_kv_heads=8, head_dim=128),  # a Llama-3-8B-like KV chunk
}


# --- page cache control -------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_fraction(paths: list[str]) -> float:
    """Share of the files' pages in the page cache (mincore over a read-only mapping)."""
    cached = total = 0
    page = mmap.PAGESIZE
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed", path)
            pages = -(-size // page)
            vec = ctypes.create_string_buffer(pages)
            try:
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed", path)
                cached += sum(b & 1 for b in vec.raw)
                total += pages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return cached / total if total else 0.0


def make_cold(paths: list[str]) -> float:
    """Flush and drop the files from the page cache; the share still resident after."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(paths)


def make_warm(paths: list[str]) -> float:
    """Read the files once through the page cache; the share resident after."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    return resident_fraction(paths)


WORKER_COUNTS = sorted({2, 4, os.cpu_count() or 1, 8})
"""``io_workers`` of the batched-read rows: the default's neighbours and one per core."""
COLD_LEFT = 0.02
"""Share of a file's pages that may stay resident for a load to count as cold."""


def best_of(passes: int, fn: Callable[[], Any], prepare: Callable[[], Any] | None = None) -> float:
    """The shortest of ``passes`` runs of ``fn`` (each after ``prepare``, not timed)."""
    times = []
    for _ in range(passes):
        if prepare is not None:
            prepare()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def make(label: str, total_bytes: int) -> list[MadeChunk]:
    spec = KVSpec.simple(f"bench/{label}", dtype="BF16", chunk_tokens=256, **SHAPES[label])
    layout = ChunkLayout(spec)
    count = max(2, total_bytes // layout.total_size)
    return sample_chunks(count, seed=len(label), layout=layout)


def bench_fs(
    label: str, chunks: list[MadeChunk], passes: int, workdir: str, workers: list[int]
) -> list[tuple]:
    size = len(chunks[0].data)
    mib = size * len(chunks) / 2**20
    root = os.path.join(workdir, f"fs-{label}")
    store = FsStore(root, create=True)
    store.put_many([(c.key, c.data) for c in chunks])
    raw_store = FsStore(root, verify=False)
    paths = [store.path_of(c.key) for c in chunks]
    keys = [c.key for c in chunks]
    buf = bytearray(size)

    def raw_read() -> None:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buf)

    def raw_read_hash() -> None:
        # what any verified copy must do: the copy, plus one hash pass while the block is
        # still in cache (the order FsStore reads in)
        view = memoryview(buf)
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                hasher = xxhash.xxh3_128()
                for offset in range(0, size, BLOCK):
                    block = view[offset : offset + BLOCK]
                    os.preadv(fd, [block], offset)
                    hasher.update(block)
            finally:
                os.close(fd)

    def mapped_copy_hash() -> None:
        # the copy done in user space (memoryview assignment: one memcpy from a mapping of
        # the page cache), then the hash of the block just written: both passes are single
        # C calls per 256 KiB, so this is what a compiled read+hash loop would cost
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            with mapping, memoryview(mapping) as view, memoryview(buf) as target:
                hasher = xxhash.xxh3_128()
                for offset in range(0, size, BLOCK):
                    end = min(offset + BLOCK, size)
                    with target[offset:end] as block, view[offset:end] as source:
                        block[:] = source
                        hasher.update(block)

    def mapped_hash() -> None:
        # no copy at all: the hash reads the page cache through a mapping
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            with mapping, memoryview(mapping) as view:
                xxhash.xxh3_128(view).digest()

    def get_verified() -> None:
        for key in keys:
            assert store.get(key) is not None

    def get_into_verified() -> None:
        for key in keys:
            assert store.get_into(key, buf) == size

    def get_into_unverified() -> None:
        for key in keys:
            assert raw_store.get_into(key, buf) == size

    def get_unverified() -> None:
        for key in keys:
            assert raw_store.get(key) is not None

    slots = host_slots(len(keys), size)

    def get_many_into_verified() -> None:
        assert all(store.get_many_into(keys, slots))

    def get_many_into_unverified() -> None:
        assert all(raw_store.get_many_into(keys, slots))

    def get_many_into_with(workers: int) -> Callable[[], None]:
        # the same batch on fewer or more threads than the default (the caller's included)
        sized = FsStore(root, io_workers=workers)

        def get() -> None:
            assert all(sized.get_many_into(keys, slots))

        return get

    raw_read()  # warm the page cache
    t_raw = best_of(passes, raw_read)
    rows = [
        (
            "fs",
            label,
            "floor: readinto+xxh3, no chunkstore",
            best_of(passes, raw_read_hash),
            t_raw,
            mib,
        ),
        (
            "fs",
            label,
            "floor: mmap+memcpy+xxh3, no chunkstore",
            best_of(passes, mapped_copy_hash),
            t_raw,
            mib,
        ),
        ("fs", label, "floor: mmap+xxh3 (no copy)", best_of(passes, mapped_hash), t_raw, mib),
        ("fs", label, "get (verify) vs raw readinto", best_of(passes, get_verified), t_raw, mib),
        (
            "fs",
            label,
            "get_into (verify) vs raw readinto",
            best_of(passes, get_into_verified),
            t_raw,
            mib,
        ),
        (
            "fs",
            label,
            "get (no verify) vs raw readinto",
            best_of(passes, get_unverified),
            t_raw,
            mib,
        ),
        (
            "fs",
            label,
            "get_into (no verify) vs raw readinto",
            best_of(passes, get_into_unverified),
            t_raw,
            mib,
        ),
        (
            "fs",
            label,
            "get_many_into (verify) vs raw readinto",
            best_of(passes, get_many_into_verified),
            t_raw,
            mib,
        ),
        (
            "fs",
            label,
            "get_many_into (no verify) vs raw",
            best_of(passes, get_many_into_unverified),
            t_raw,
            mib,
        ),
    ]
    for count in workers:
        rows.append(
            (
                "fs",
                label,
                f"get_many_into (verify, {count} io_workers)",
                best_of(passes, get_many_into_with(count)),
                t_raw,
                mib,
            )
        )

    # Cold: every file dropped from the page cache before each pass (read_mode "auto" then
    # reads it around the page cache, O_DIRECT: a 2 MiB chunk, or a 32 MiB one into slots on
    # huge pages; into 4 KiB pages a 32 MiB one with readahead, dropped again), against one
    # thread's plain reads of the same cold files.
    def drop() -> None:
        left = make_cold(paths)
        if left > COLD_LEFT:
            print(f"note: {label} files still {left:.0%} resident after DONTNEED")

    t_raw_cold = best_of(passes, raw_read, drop)
    for count in workers:
        rows.append(
            (
                "fs",
                label,
                f"cold get_many_into (verify, {count} io_workers)",
                best_of(passes, get_many_into_with(count), drop),
                t_raw_cold,
                mib,
            )
        )
    raw_read()  # warm again for what follows

    counter = iter(range(10**9))

    def raw_write() -> None:
        directory = os.path.join(workdir, f"raw-{label}-{next(counter)}")
        os.makedirs(directory)
        for i, chunk in enumerate(chunks):
            tmp = os.path.join(directory, f".{i}.tmp")
            with open(tmp, "wb", buffering=0) as f:
                f.write(chunk.data)
            os.replace(tmp, os.path.join(directory, f"{i}.kvc"))
        shutil.rmtree(directory)

    def store_put(workers: int) -> Callable[[], None]:
        def put() -> None:
            root = os.path.join(workdir, f"put-{label}-{next(counter)}")
            target = FsStore(root, create=True, io_workers=workers)
            target.put_many([(c.key, c.data) for c in chunks])
            target.close()
            shutil.rmtree(target.root)

        return put

    sources = host_slots(len(chunks), size)
    for source, chunk in zip(sources, chunks):
        source[:] = chunk.data

    def put_direct_from_slots(count: int) -> float:
        # A write-back's own work is timed: the store is made before, synced (no other dirty
        # pages flushed meanwhile) and removed after, outside the timed call.
        made: list[FsStore] = []

        def finish() -> None:
            while made:
                old = made.pop()
                old.close()
                shutil.rmtree(old.root)

        def prepare() -> None:
            finish()
            root = os.path.join(workdir, f"direct-{label}-{next(counter)}")
            made.append(FsStore(root, create=True, io_workers=count, write_mode="direct"))
            os.sync()

        def put() -> None:
            assert all(made[-1].put_many(list(zip(keys, sources))))

        try:
            return best_of(passes, put, prepare)
        finally:
            finish()

    t_raw_write = best_of(passes, raw_write)
    rows.append(
        ("fs", label, "put vs raw write+rename", best_of(passes, store_put(1)), t_raw_write, mib)
    )
    rows.append(
        (
            "fs",
            label,
            "put_many (4 workers) vs raw",
            best_of(passes, store_put(4)),
            t_raw_write,
            mib,
        )
    )
    for count in (4, 8):
        rows.append(
            (
                "fs",
                label,
                f"put_many direct from slots ({count} workers) vs raw",
                put_direct_from_slots(count),
                t_raw_write,
                mib,
            )
        )
    store.close()
    raw_store.close()
    return rows


def host_slots(count: int, size: int) -> list[memoryview]:
    """The slots of a host cache's private pool (page-aligned, what O_DIRECT needs; on huge
    pages where the kernel has them), ``size`` bytes each. The views keep the pool mapped."""
    pool = SlotPool.create(size, count, pin_memory=False)
    return [pool.view(slot) for slot in range(count)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bench_s3(chunks: list[MadeChunk], passes: int) -> list[tuple]:
    try:
        import boto3
        import s3fs
        from moto.server import ThreadedMotoServer

        from chunkstore.backends._s3 import S3Store
    except ImportError as exc:
        print(f"S3 benchmark skipped: {exc} (pip install 'chunkstore[test]')")
        return []
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        store = S3Store("bench", "store", endpoint_url=endpoint, track_access=False)
        raw = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        mib = sum(len(c.data) for c in chunks) / 2**20
        keys = [c.key for c in chunks]
        raw_paths = [f"bench/raw/{c.key.hex}" for c in chunks]

        def raw_put() -> None:
            raw.pipe({p: c.data for p, c in zip(raw_paths, chunks)})

        def store_put() -> None:
            store.put_many([(c.key, c.data) for c in chunks])

        def raw_get() -> None:
            got = raw.cat(raw_paths)
            assert len(got) == len(raw_paths)

        def store_get() -> None:
            assert all(d is not None for d in store.get_many(keys))

        t_raw_put = best_of(passes, raw_put)
        t_put = best_of(passes, store_put)
        t_raw_get = best_of(passes, raw_get)
        t_get = best_of(passes, store_get)
        store.close()
        rows = [
            ("s3", "2MiB", "put_many vs s3fs pipe", t_put, t_raw_put, mib),
            ("s3", "2MiB", "get_many (verify) vs s3fs cat", t_get, t_raw_get, mib),
        ]
        try:
            nixl = S3Store(
                "bench", "nixl", endpoint_url=endpoint, track_access=False, data_path="nixl"
            )
        except ChunkStoreError as exc:
            print(f"S3 data_path=nixl skipped: {exc}")
            return rows

        def nixl_put() -> None:
            assert all(nixl.put_many([(c.key, c.data) for c in chunks]))

        def nixl_get() -> None:
            assert all(d is not None for d in nixl.get_many(keys))

        t_nixl_put = best_of(passes, nixl_put)
        t_nixl_get = best_of(passes, nixl_get)
        nixl.close()
        return rows + [
            ("s3", "2MiB", "nixl put_many vs s3fs pipe", t_nixl_put, t_raw_put, mib),
            ("s3", "2MiB", "nixl get_many (verify) vs s3fs cat", t_nixl_get, t_raw_get, mib),
        ]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=192, help="MiB of chunks per size (fs)")
    parser.add_argument("--passes", type=int, default=3, help="take the best of this many")
    parser.add_argument("--s3-mib", type=int, default=32, help="MiB of chunks for the S3 part")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 part")
    parser.add_argument(
        "--workers",
        default=",".join(str(n) for n in WORKER_COUNTS),
        help="io_workers of the batched-read rows, warm and cold (comma-separated)",
    )
    args = parser.parse_args(argv)
    workers = [int(n) for n in args.workers.split(",") if n]
    rows: list[tuple] = []
    workdir = tempfile.mkdtemp(prefix="chunkstore-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        for label in SHAPES:
            rows += bench_fs(label, make(label, args.mib << 20), args.passes, workdir, workers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.no_s3:
        rows += bench_s3(make("2MiB", args.s3_mib << 20), args.passes)
    print(
        f"{'store':5} {'chunk':6} {'measurement':44} {'MiB/s':>8} {'base MiB/s':>10} {'ratio':>6}"
    )
    for kind, label, what, t, t_base, mib in rows:
        print(f"{kind:5} {label:6} {what:44} {mib / t:8.0f} {mib / t_base:10.0f} {t_base / t:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
