"""CLI maintenance benchmarks: ``chunkstore verify`` and ``chunkstore prune`` in chunks/s.

    .venv/bin/python tools/bench_cli.py            # 100,000 tiny chunks (default; ~1 min)
    .venv/bin/python tools/bench_cli.py 20000      # a quicker look

A store of tiny chunks (16 tokens, one layer, one KV head: 4.4 KiB files,
mostly the 4 KiB-aligned header) on a local directory, warm page cache, so
per-chunk overhead dominates, which is what matters for 100k-chunk stores. Each
command runs in-process through ``chunkstore.cli.main.main`` (``--quiet``,
text output), and is compared with a baseline measured in the same run on the
same files:

* verify vs *raw read + xxh3-128*: walk the tree with ``os.scandir``, read each
  file whole and hash it (the least work any checksum verification can do);
* prune vs *raw unlink*: walk the tree and ``os.unlink`` every file;
* prune --dry-run (listing and planning only) vs the same walk, stat only.

Ratios near 1.0 mean the CLI adds little over the filesystem; numbers never
fail the run.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import xxhash

from chunkstore.backends._fs import FsStore
from chunkstore.cli.main import main as cli_main
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import conversation_tokens, make_chunks, small_spec

DEFAULT_COUNT = 100_000
CONVERSATION = 500  # chunks per conversation (keys chain within one)


def tiny_chunks(count: int) -> Iterator[tuple[object, bytes]]:
    """``count`` valid tiny chunks, in conversations of CONVERSATION chunks."""
    layout = ChunkLayout(small_spec(16, num_layers=1, num_kv_heads=1, head_dim=8))
    made = 0
    seed = 0
    while made < count:
        n = min(CONVERSATION, count - made)
        for chunk in make_chunks(layout, conversation_tokens(seed, n * 16)):
            yield chunk.key, chunk.data
        made += n
        seed += 1


def chunk_files(root: str) -> Iterator[str]:
    """Every ``.kvc`` file under ``root`` (plain os.scandir walk)."""
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.name.endswith(".kvc"):
                    yield entry.path


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_cli(*args: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return cli_main(list(args))


def raw_read_and_hash(root: str) -> int:
    n = 0
    for path in chunk_files(root):
        with open(path, "rb", buffering=0) as f:
            xxhash.xxh3_128(f.read()).digest()
        n += 1
    return n


def raw_stat(root: str) -> int:
    return sum(1 for p in chunk_files(root) if os.stat(p).st_size >= 0)


def raw_unlink(root: str) -> int:
    n = 0
    for path in list(chunk_files(root)):
        os.unlink(path)
        n += 1
    return n


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_COUNT
    base = tempfile.mkdtemp(prefix="bench-cli-")
    try:
        root = os.path.join(base, "store")
        start = time.perf_counter()
        chunks = list(tiny_chunks(count))
        with FsStore(root, create=True) as store:
            for i in range(0, len(chunks), 1000):
                store.put_many(chunks[i : i + 1000])
        size = sum(len(d) for _, d in chunks)
        print(
            f"store: {count} chunks of {len(chunks[0][1])} bytes ({size / 2**20:.1f} MiB), "
            f"local dir, warm page cache; built in {time.perf_counter() - start:.1f}s"
        )
        raw_read_and_hash(root)  # warm the page cache and dentries

        rows = []
        base_verify = timed(lambda: raw_read_and_hash(root))
        cli_verify = timed(lambda: run_cli("verify", root, "--quiet"))
        rows.append(("verify", cli_verify, "raw read + xxh3-128", base_verify))
        base_list = timed(lambda: raw_stat(root))
        cli_dry = timed(lambda: run_cli("prune", root, "--max-bytes", "0", "--dry-run", "--quiet"))
        rows.append(("prune --dry-run", cli_dry, "raw walk + stat", base_list))
        cli_prune = timed(lambda: run_cli("prune", root, "--max-bytes", "0", "--quiet"))
        left = sum(1 for _ in chunk_files(root))
        assert left == 0, f"prune left {left} chunks"
        with FsStore(root) as store:  # the same files again, for the unlink baseline
            for i in range(0, len(chunks), 1000):
                store.put_many(chunks[i : i + 1000])
        base_prune = timed(lambda: raw_unlink(root))
        rows.append(("prune --max-bytes 0", cli_prune, "raw walk + unlink", base_prune))

        print(f"\n{'command':<22}{'chunks/s':>11}   {'baseline':<22}{'chunks/s':>11}  ratio")
        for name, seconds, base_name, base_seconds in rows:
            print(
                f"{name:<22}{count / seconds:>11,.0f}   {base_name:<22}"
                f"{count / base_seconds:>11,.0f}  {base_seconds / seconds:5.2f}x"
            )
        if count < 100_000:
            print(
                f"\n(ran {count} chunks, not the issue's 100k; pass 100000 to run the full count)"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
