"""A host cache in named shared memory, used from a second process."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore.cache import HostCache, SlotPool
from chunkstore.cache._pool import SHM_DIR
from chunkstore.errors import StoreError
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import MadeChunk
from tests.cache.shm_worker import worker

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"chunkstore-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    Path(SHM_DIR, name).unlink(missing_ok=True)


def test_name_is_exclusive_and_removed_on_close(layout: ChunkLayout, shm_name: str) -> None:
    cache = HostCache(layout, num_slots=2, shm_name=shm_name)
    assert (SHM_DIR / shm_name).exists()
    with pytest.raises(StoreError, match="already exists"):
        HostCache(layout, num_slots=2, shm_name=shm_name)
    cache.close()
    assert not (SHM_DIR / shm_name).exists()
    with pytest.raises(StoreError, match="no shared pool"):
        SlotPool.attach(shm_name)


def test_owner_that_exits_without_close_removes_its_name(shm_name: str) -> None:
    # A host cache that is never closed: the process ends and /dev/shm must not keep its pool.
    script = (
        "import sys\n"
        "from chunkstore.cache import HostCache\n"
        "from chunkstore.testing.factories import small_spec\n"
        "from chunkstore.format import ChunkLayout\n"
        "cache = HostCache(ChunkLayout(small_spec()), num_slots=2, shm_name=sys.argv[1])\n"
        "print(cache.pool.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, shm_name], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == shm_name
    assert not (SHM_DIR / shm_name).exists()


def test_forked_child_does_not_remove_the_owners_name(shm_name: str) -> None:
    pool = SlotPool.create(4096, 2, name=shm_name, pin_memory=False)
    try:
        child = os.fork()
        if child == 0:  # the child drops its copy of the pool and exits through atexit
            del pool
            gc.collect()
            os._exit(0)
        os.waitpid(child, 0)
        assert (SHM_DIR / shm_name).exists()
    finally:
        pool.close()
    assert not (SHM_DIR / shm_name).exists()


def test_replace_takes_over_a_leftover_pool(layout: ChunkLayout, shm_name: str) -> None:
    (SHM_DIR / shm_name).write_bytes(b"left behind by a crashed owner")
    with pytest.raises(StoreError, match="already exists"):
        HostCache(layout, num_slots=2, shm_name=shm_name)
    with HostCache(layout, num_slots=2, shm_name=shm_name, shm_replace=True) as cache:
        assert cache.pool.name == shm_name


def test_attach_rejects_foreign_memory(shm_name: str) -> None:
    (SHM_DIR / shm_name).write_bytes(b"\0" * 8192)
    with pytest.raises(StoreError, match="not a chunkstore slot pool"):
        SlotPool.attach(shm_name)


def test_same_process_attach_sees_slots(
    layout: ChunkLayout, chain: list[MadeChunk], shm_name: str
) -> None:
    with HostCache(layout, num_slots=4, shm_name=shm_name) as cache:
        cache.put(chain[0].key, chain[0].data)
        other = SlotPool.attach(shm_name)
        try:
            assert (other.slot_size, other.num_slots) == (layout.total_size, 4)
            got = other.acquire(chain[0].key)
            assert got is not None and bytes(got[1]) == chain[0].data
            assert cache.stats().pinned_slots == 1
            other.release(got[0])
            assert other.find(chain[1].key) is None
        finally:
            other.close()


@pytest.mark.slow
def test_second_process_reads_pins_and_writes(
    layout: ChunkLayout, chain: list[MadeChunk], shm_name: str
) -> None:
    context = multiprocessing.get_context("spawn")
    commands: Any = context.Queue()
    replies: Any = context.Queue()
    with HostCache(layout, num_slots=4, policy="lru", shm_name=shm_name) as cache:
        cache.put_many([(c.key, c.data) for c in chain[:2]])
        process = context.Process(target=worker, args=(shm_name, commands, replies))
        process.start()
        try:

            def ask(*command: Any) -> Any:
                commands.put(command)
                return replies.get(timeout=60)

            # The other process finds and reads chunk 0, and keeps it pinned.
            assert ask("read", 0)[::3] == ("pinned", True)
            assert ask("read", 5) == ("miss", 5)
            # Pinned from another process: a full scan of new chunks cannot evict it.
            cache.put_many([(c.key, c.data) for c in chain[2:9]])
            assert cache.exists(chain[0].key)
            assert ask("release", 0) == ("released", 0)
            cache.put_many([(c.key, c.data) for c in chain[9:12]])
            assert not cache.exists(chain[0].key)
            assert ask("find", 0) == ("found", 0, None)

            # The other process writes a chunk into a slot this process reserved for it.
            lease = cache.reserve(chain[0].key)
            assert lease is not None
            assert ask("write", 0, lease.slot, lease.generation) == ("written", 0, True)
            cache.commit(lease, len(chain[0].data))
            assert cache.get(chain[0].key) == chain[0].data
            assert ask("find", 0)[2] == lease.slot
            assert ask("exit") == ("bye",)
        finally:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        assert process.exitcode == 0
        assert cache.stats().pinned_slots == 0
