"""Reading request traces for the cache simulator.

Two JSON Lines formats, one request per line. Blank lines are skipped.

* **Mooncake**, the ``kvcache-ai/Mooncake`` FAST'25 traces.
  Fields: ``timestamp`` in ms, ``input_length`` and ``output_length`` in tokens,
  and ``hash_ids``.
  ``hash_ids`` has one integer per started block of ``block_tokens`` tokens.
  Equal ids are the same prefix-chained block.
  All four fields are required.
* **Tokens**: ``tokens``, a list of token ids.
  Blocks are keyed with :func:`~chunkstore.hashing.chain_keys`, as a store would key chunks.
  ``timestamp`` and ``output_length`` are optional.

Both formats keep only a request's **full** blocks, as a serving engine does.
vLLM and chunkstore's connector cache and load whole chunks only.
A partial last block is never looked up nor admitted.
Its tokens always count as recomputed.
For a Mooncake request these are the first ``input_length // block_tokens`` hash ids.
The published traces name the partial last block too.
A request with fewer hash ids than that keeps all of them.
Its prompt tokens past its last named block count as recomputed.

Every defect is a :class:`TraceError` that names the file and line; a trace with no
request, or with no block in any request, is one too.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

from chunkstore.errors import ConfigError

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
TOKEN_TRACE_FINGERPRINT = bytes(32)
"""Model fingerprint under which token traces are keyed (any fixed value works: only
equality between blocks matters to the simulator)."""


class TraceError(ConfigError):
    """A trace file is empty, unreadable, or a line is not a valid request."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp: float
    """Arrival time in the trace's unit (milliseconds for Mooncake traces)."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    blocks: tuple[Hashable, ...]
    """Full blocks' ids in prompt order (hash ids, or chunk keys for token traces)."""


@dataclass(frozen=True, slots=True)
class Trace:
    """A whole trace, ready to replay."""

    source: str
    """Where it was read from."""
    requests: tuple[TraceRequest, ...]
    """Requests in file order."""
    block_tokens: int
    """Tokens per block."""

    @property
    def accesses(self) -> int:
        """Total block lookups (every block of every request)."""
        return sum(len(r.blocks) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        """Distinct block ids: the working set a cache of infinite size would hold."""
        return len({b for r in self.requests for b in r.blocks})

    @property
    def input_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(r.input_length for r in self.requests)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_request(record: object, *, block_tokens: int, root: bytes) -> TraceRequest:
    """One decoded JSON line as a request; raises :class:`TraceError` without a location."""
    if not isinstance(record, dict):
        raise TraceError(f"expected a JSON object, got {type(record).__name__}")
    if "tokens" in record and "hash_ids" not in record:
        tokens = record["tokens"]
        if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < 2**32 for t in tokens):
            raise TraceError("'tokens' must be a list of token ids (integers in 0..2^32-1)")
        timestamp = record.get("timestamp", 0)
        output_length = record.get("output_length", 0)
        if not _is_number(timestamp):
            raise TraceError("'timestamp' must be a number")
        if not _is_int(output_length) or output_length < 0:
            raise TraceError("'output_length' must be a non-negative integer")
        # Imported here: Mooncake traces, and the CLI's parser for --help, need no numpy.
        import numpy as np

        from chunkstore.hashing import chain_keys

        array = np.asarray(tokens, dtype=np.uint32)
        keys = chain_keys(array, root=root, chunk_tokens=block_tokens)
        return TraceRequest(float(timestamp), len(tokens), int(output_length), tuple(keys))
    missing = [f for f in MOONCAKE_FIELDS if f not in record]
    if missing:
        raise TraceError(
            f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            f"(a Mooncake request needs {', '.join(MOONCAKE_FIELDS)}; a token request needs tokens)"
        )
    if not _is_number(record["timestamp"]):
        raise TraceError("'timestamp' must be a number")
    for field in ("input_length", "output_length"):
        if not _is_int(record[field]) or record[field] < 0:
            raise TraceError(f"{field!r} must be a non-negative integer")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        raise TraceError("'hash_ids' must be a list of integers")
    input_length = record["input_length"]
    full_blocks = hash_ids[: input_length // block_tokens]
    return TraceRequest(
        float(record["timestamp"]), input_length, record["output_length"], tuple(full_blocks)
    )


def parse_trace(lines: Iterable[str], *, source: str = "<trace>", block_tokens: int = 512) -> Trace:
    """Parse JSON Lines text; errors name ``source`` and the 1-based line number."""
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
    from chunkstore.hashing import namespace_root

    root = namespace_root(TOKEN_TRACE_FINGERPRINT)
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{source} line {number}: not valid JSON ({exc})") from None
        except RecursionError:  # json recurses once per nesting level: '[' * 10**5 ends here
            raise TraceError(
                f"{source} line {number}: not valid JSON (nested too deeply)"
            ) from None
        try:
            requests.append(parse_request(record, block_tokens=block_tokens, root=root))
        except TraceError as exc:
            raise TraceError(f"{source} line {number}: {exc}") from None
    if not requests:
        raise TraceError(f"{source}: the trace is empty (no requests)")
    if not any(r.blocks for r in requests):
        # Nothing a cache could hold: every capacity would be a share of zero blocks.
        raise TraceError(
            f"{source}: no request has a block (empty hash_ids, or prompts shorter than "
            f"one full block of {block_tokens} tokens): nothing to cache"
        )
    return Trace(source, tuple(requests), block_tokens)


def load_trace(path: str | Path, *, block_tokens: int = 512, limit: int | None = None) -> Trace:
    """Read a trace file (see the module docstring); ``limit`` keeps the first requests only."""
    source = str(path)
    try:
        with open(path, encoding="utf-8") as handle:
            lines: Iterable[str] = handle
            if limit is not None:
                lines = _first_requests(handle, limit)
            return parse_trace(lines, source=source, block_tokens=block_tokens)
    except OSError as exc:
        raise TraceError(f"cannot read trace {source}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"{source}: not a UTF-8 text file") from None


def _first_requests(lines: Iterable[str], limit: int) -> Iterable[str]:
    if limit < 1:
        raise ConfigError(f"limit must be at least 1 request, got {limit}")
    kept = 0
    for line in lines:
        if kept >= limit:
            return
        if line.strip():
            kept += 1
        yield line
