"""Write the frozen store fixtures under ``tests/fixtures/`` (restic ``testdata/*.tar.gz`` style).

    .venv/bin/python tools/make_fixtures.py            # rewrite tests/fixtures/*.tar.gz
    .venv/bin/python tools/make_fixtures.py --check    # exit 1 if the checked-in files differ

The fixtures are *frozen*: they are checked in and the CLI tests read them as
they are, so a later change to the writer cannot silently change what old
stores look like. Rerun this script only to add cases, and say so in the
commit. Output is byte-for-byte deterministic (fixed times, owners, order,
gzip header), so ``--check`` shows whether the files match this script.

Fixtures:

``damaged-store.tar.gz``
    ``store/`` holds a filesystem store (layout 1) with good chunks of two
    models and every kind of damage ``verify``/``inspect``/``prune`` must
    handle; ``manifest.json`` names which key is which case. Chunk ``a<i>``
    is written at ``BASE_TIME + i days``, ``b<i>`` at ``BASE_TIME + (20 + i)
    days``; ``a1`` has an access record at ``BASE_TIME + 30 days`` (it was read
    last). Tests shift all times so the newest is one hour ago.

``not-a-store.tar.gz``
    ``dir/`` with ordinary files and no layout marker: must be refused.

``future-layout.tar.gz``
    ``store/`` whose marker says layout 2: must be refused with "upgrade".
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np

from chunkstore.format import ChunkLayout, recompress
from chunkstore.hashing import ChunkKey
from chunkstore.testing.factories import conversation_tokens, make_chunks, small_spec

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
BASE_TIME = 1748736000  # 2025-06-01T00:00:00Z
DAY = 86400
MARKER = {
    "created": float(BASE_TIME),
    "format": "chunkstore",
    "layout": 1,
    "path": "<namespace>/<ab>/<cd>/<hex>.kvc",
}

#: What each damaged case is, as `verify` must classify it (status, decoder error class)
#: and as `inspect` sees it from the header alone (None: the header reads fine).
CASES: dict[str, tuple[str, str, str | None]] = {
    "a0": ("ok", "", None),
    "a1": ("ok", "", None),
    "a2": ("ok", "", None),
    "a3": ("ok", "", None),
    "a4": ("corrupt", "ChecksumMismatch", None),  # one payload bit flipped
    "a5": ("corrupt", "TruncatedChunk", None),  # cut inside the payload
    "a6": ("corrupt", "TruncatedChunk", "TruncatedChunk"),  # cut inside the header
    "a7": ("unsupported", "UnsupportedVersion", "UnsupportedVersion"),  # major 2
    "a8": ("unsupported", "UnsupportedVersion", "UnsupportedVersion"),  # major 0
    "a9": ("corrupt", "KeyMismatch", "KeyMismatch"),  # a0's bytes under a9's name
    "a10": ("corrupt", "BadMagic", "BadMagic"),  # not a chunk at all
    "a11": ("corrupt", "TruncatedChunk", "TruncatedChunk"),  # empty file
    "a12": ("ok", "", None),  # zstd-compressed
    "b0": ("ok", "", None),
    "b1": ("ok", "", None),
    "b2": ("ok", "", None),
}


class _Tar:
    """A deterministic tar.gz being built in memory."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, int]] = {}

    def add(self, path: str, data: bytes, mtime: int) -> None:
        self.files[path] = (data, mtime)

    def bytes(self) -> bytes:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            dirs: set[str] = set()
            for path in sorted(self.files):
                parts = path.split("/")[:-1]
                for depth in range(1, len(parts) + 1):
                    directory = "/".join(parts[:depth])
                    if directory not in dirs:
                        dirs.add(directory)
                        tar.addfile(self._info(directory, 0, BASE_TIME, tarfile.DIRTYPE))
                data, mtime = self.files[path]
                tar.addfile(self._info(path, len(data), mtime, tarfile.REGTYPE), io.BytesIO(data))
        out = io.BytesIO()
        with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9, mtime=0) as gz:
            gz.write(raw.getvalue())
        return out.getvalue()

    @staticmethod
    def _info(name: str, size: int, mtime: int, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.size = size
        info.mtime = mtime
        info.type = kind
        info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info


def _with_version(data: bytes, version: str) -> bytes:
    """The chunk with its format version field replaced (same width, so offsets hold)."""
    old = b'"chunkstore":"1.0"'
    assert old in data and len(version) == 3
    return data.replace(old, f'"chunkstore":"{version}"'.encode(), 1)


def damaged_store() -> bytes:
    """The damaged-store fixture."""
    layout_a = ChunkLayout(small_spec(16, num_layers=1, num_kv_heads=2, model_id="fixture/a"))
    layout_b = ChunkLayout(small_spec(16, num_layers=1, num_kv_heads=1, model_id="fixture/b"))
    made_a = make_chunks(layout_a, conversation_tokens(1, 14 * 16))
    made_b = make_chunks(layout_b, conversation_tokens(2, 4 * 16))
    keys: dict[str, ChunkKey] = {}
    tar = _Tar()
    tar.add(
        "store/chunkstore-layout.json",
        (json.dumps(MARKER, sort_keys=True) + "\n").encode(),
        BASE_TIME,
    )

    def put(name: str, key: ChunkKey, data: bytes, mtime: int) -> None:
        keys[name] = key
        tar.add(f"store/{key.path}", data, mtime)

    for i, chunk in enumerate(made_a[:13]):
        name, mtime = f"a{i}", BASE_TIME + i * DAY
        data = chunk.data
        if name == "a4":
            flipped = bytearray(data)
            flipped[-100] ^= 0x10
            data = bytes(flipped)
        elif name == "a5":
            data = data[: len(data) - 300]
        elif name == "a6":
            data = data[:100]
        elif name == "a7":
            data = _with_version(data, "2.0")
        elif name == "a8":
            data = _with_version(data, "0.9")
        elif name == "a9":
            data = made_a[0].data
        elif name == "a10":
            data = np.random.default_rng(10).integers(0, 256, 3000, dtype=np.uint8).tobytes()
        elif name == "a11":
            data = b""
        elif name == "a12":
            data = recompress(data, "zstd")
        put(name, chunk.key, data, mtime)
    tar.add(
        f"store/{keys['a1'].path}.atime",
        f"{BASE_TIME + 30 * DAY:.3f}".encode(),
        BASE_TIME + 30 * DAY,
    )
    for i, chunk in enumerate(made_b[:3]):
        put(f"b{i}", chunk.key, chunk.data, BASE_TIME + (20 + i) * DAY)

    # Foreign files: a note in a fan-out directory, and a valid chunk in the wrong fan-out.
    a0 = keys["a0"]
    readme = f"store/{a0.namespace}/{a0.hex[0:2]}/{a0.hex[2:4]}/README.txt"
    tar.add(readme, b"someone's notes, not a chunk\n", BASE_TIME)
    stray = made_b[3]
    wrong = "00" if stray.key.hex[0:2] != "00" else "01"
    misplaced = f"store/{stray.key.namespace}/{wrong}/{stray.key.hex[2:4]}/{stray.key.hex}.kvc"
    tar.add(misplaced, stray.data, BASE_TIME)
    # Orphan temp files of writers killed mid-write (unique names: .<hex>.<pid>.<rand>.tmp).
    temps = []
    for source, pid, rand in ((made_a[2], 4242, "0a1b2c3d4e5f"), (made_b[1], 777, "fedcba987654")):
        key = source.key
        path = f"store/{key.namespace}/{key.hex[0:2]}/{key.hex[2:4]}/.{key.hex}.{pid}.{rand}.tmp"
        tar.add(path, source.data[:2048], BASE_TIME)
        temps.append(path)
    # A chunk quarantined earlier, with its reason.
    gone = made_a[13]
    qpath = f"store/quarantine/{gone.key.namespace}/{gone.key.hex}.kvc"
    tar.add(qpath, gone.data[:5000], BASE_TIME)
    tar.add(qpath + ".reason", f"{BASE_TIME}.000 ChecksumMismatch: damaged\n".encode(), BASE_TIME)

    manifest = {
        "_comment": "Written by tools/make_fixtures.py; keys of each case in store/.",
        "base_time": BASE_TIME,
        "chunks": {
            name: {
                "namespace": keys[name].namespace,
                "key": keys[name].hex,
                "status": CASES[name][0],
                "problem": CASES[name][1],
                "header_problem": CASES[name][2],
            }
            for name in CASES
        },
        "fingerprints": {"a": layout_a.fingerprint.hex(), "b": layout_b.fingerprint.hex()},
        "foreign": [p.removeprefix("store/") for p in sorted([readme, misplaced])],
        "temp": [p.removeprefix("store/") for p in sorted(temps)],
        "quarantined": [qpath.removeprefix("store/")],
        "recently_used": "a1",
    }
    tar.add(
        "manifest.json", (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(), BASE_TIME
    )
    return tar.bytes()


def not_a_store() -> bytes:
    """A directory of unrelated files."""
    tar = _Tar()
    tar.add("dir/photo.jpg", b"\xff\xd8\xff\xe0 not really a photo", BASE_TIME)
    tar.add("dir/notes/todo.txt", b"buy milk\n", BASE_TIME)
    return tar.bytes()


def future_layout() -> bytes:
    """A store whose layout marker is from a future chunkstore."""
    tar = _Tar()
    marker = dict(MARKER, layout=2)
    tar.add(
        "store/chunkstore-layout.json",
        (json.dumps(marker, sort_keys=True) + "\n").encode(),
        BASE_TIME,
    )
    return tar.bytes()


BUILDERS = {
    "damaged-store.tar.gz": damaged_store,
    "not-a-store.tar.gz": not_a_store,
    "future-layout.tar.gz": future_layout,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the checked-in files instead of writing them",
    )
    parser.add_argument("--out", type=Path, default=FIXTURES, help="directory to write into")
    args = parser.parse_args(argv)
    differ = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name, build in BUILDERS.items():
        data = build()
        target = args.out / name
        if args.check:
            if not target.exists() or target.read_bytes() != data:
                differ.append(name)
            continue
        target.write_bytes(data)
        print(f"wrote {target} ({len(data)} bytes)")
    if differ:
        print(f"differ from tools/make_fixtures.py: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
