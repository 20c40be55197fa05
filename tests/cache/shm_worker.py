"""The second process of the shared-pool test: attaches by name, reads, pins and writes slots."""

from __future__ import annotations

from multiprocessing.queues import Queue
from typing import Any

from chunkstore.cache import SlotPool, StaleSlot
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import sample_chunks, small_spec


def worker(name: str, commands: Queue[Any], replies: Queue[Any]) -> None:
    """Serve the owner's commands until ``("exit",)``; every reply is a plain tuple."""
    chain = sample_chunks(12, seed=21, layout=ChunkLayout(small_spec()))
    pool = SlotPool.attach(name)
    held: dict[int, int] = {}
    try:
        while True:
            command = commands.get(timeout=60)
            if command[0] == "exit":
                replies.put(("bye",))
                return
            if command[0] == "read":  # acquire, compare, keep the pin
                i = command[1]
                got = pool.acquire(chain[i].key)
                if got is None:
                    replies.put(("miss", i))
                    continue
                slot, view = got
                held[i] = slot
                replies.put(("pinned", i, slot, bytes(view) == chain[i].data))
            elif command[0] == "release":
                pool.release(held.pop(command[1]))
                replies.put(("released", command[1]))
            elif command[0] == "write":  # fill a slot the owner reserved for chunk i
                i, slot, generation = command[1:]
                try:
                    target = pool.writable(slot, generation + 1)
                except StaleSlot:
                    stale_refused = True
                else:
                    stale_refused = False
                target = pool.writable(slot, generation)
                target[: len(chain[i].data)] = chain[i].data
                replies.put(("written", i, stale_refused))
            elif command[0] == "find":
                replies.put(("found", command[1], pool.find(chain[command[1]].key)))
    finally:
        pool.close()
