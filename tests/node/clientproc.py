"""A simulated engine process for the node tests: ``python -m tests.node.clientproc MODE ...``.

Modes (``SOCKET SEED COUNT [NAME]``): ``save`` stores a conversation's chunks
and exits; ``get`` reads them back and prints how many matched byte for byte;
``hold-lease`` pins them and ``hold-reservation`` reserves slots for them and
writes half of each, then both print ``ready`` and wait to be killed.
``rank R TP [ENGINE]`` (after NAME) is TP rank R of TP of engine ENGINE (default
``engine``): it writes only its heads of each chunk, commits them and exits
(``rank-stay``: then waits to be stopped, as a rank of a running engine;
``hold-rank``: writes them and waits to be killed).
Chunks are derived from the seed, so every process knows the exact bytes.
"""

from __future__ import annotations

import sys
import threading

from chunkstore.format import ChunkLayout
from chunkstore.node import NodeClient, NodeStore, RankShare, engine_identity
from chunkstore.testing.factories import sample_chunks, small_spec


def main(argv: list[str]) -> int:
    mode, socket, seed, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    name = argv[4] if len(argv) > 4 else mode
    chunks = sample_chunks(count, seed=seed)
    client = NodeClient(socket, slot_size=len(chunks[0].data), client_name=name, timeout_s=30)
    if not client.attach():
        print("unattached", flush=True)
        return 1
    keys = [c.key for c in chunks]
    if mode == "save":
        stored = NodeStore(client).put_many([(c.key, c.data) for c in chunks])
        print(f"saved {sum(stored)}", flush=True)
        client.close()
        return 0
    if mode == "get":
        got = NodeStore(client).get_many(keys)
        same = sum(g == c.data for g, c in zip(got, chunks))
        print(f"matched {same}", flush=True)
        client.close()
        return 0
    if mode in ("rank", "rank-stay", "hold-rank"):
        rank, tp = int(argv[5]), int(argv[6])
        engine = engine_identity(argv[7] if len(argv) > 7 else "engine")
        share = RankShare(
            rank, tp, [c.parent for c in chunks], [list(c.tokens) for c in chunks], engine
        )
        reservation = client.reserve(keys, part=share)
        layout = ChunkLayout(small_spec())
        for chunk, view in zip(chunks, reservation.views):
            if view is not None:
                for r in layout.rank_ranges(rank, tp, for_write=True):
                    end = r.offset + r.length
                    view[r.offset : end] = chunk.data[r.offset : end]
        if mode == "hold-rank":
            print(f"ready {sum(v is not None for v in reservation.views)}", flush=True)
            threading.Event().wait()  # until killed
        stored = client.commit(reservation, [len(c.data) for c in chunks])
        print(f"committed {sum(stored)}", flush=True)
        if mode == "rank-stay":  # a rank of an engine that keeps running
            threading.Event().wait()
        client.close()
        return 0
    if mode == "hold-lease":
        read = client.acquire(keys)
        print(f"ready {sum(v is not None for v in read.views)}", flush=True)
    elif mode == "hold-reservation":
        reservation = client.reserve(keys)
        for chunk, view in zip(chunks, reservation.views):
            if view is not None:
                half = len(chunk.data) // 2
                view[:half] = chunk.data[:half]
        print(f"ready {sum(v is not None for v in reservation.views)}", flush=True)
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    threading.Event().wait()  # until killed
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
