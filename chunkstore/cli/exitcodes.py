"""Exit codes of the ``chunkstore`` command, one per kind of failure."""

from __future__ import annotations

from chunkstore.errors import (
    ChunkStoreError,
    ConfigError,
    FormatError,
    KeyParseError,
    MissingDependency,
    StoreError,
)

OK = 0
FAILURE = 1
"""The command ran but found problems (``verify`` found corrupt chunks, a check failed)."""
USAGE = 2
"""Bad arguments: an invalid URL, size, age or option (argparse uses 2 as well)."""
MISSING_EXTRA = 3
"""An optional dependency is missing; the message names the extra to install."""
STORE_UNAVAILABLE = 4
"""The store cannot be opened or read (missing directory or bucket, bad credentials)."""
BAD_CHUNK = 5
"""A file given on the command line is not a valid chunk."""

EXIT_CODES_HELP = """exit codes:
  0  success
  1  the command ran and found problems (e.g. verify found corrupt chunks)
  2  bad arguments (URL, size, age, option)
  3  an optional dependency is missing (the message names the extra)
  4  the store cannot be opened or read
  5  a file given is not a valid chunk
"""


def exit_code_for(exc: ChunkStoreError) -> int:
    """Map an error to its documented exit code."""
    if isinstance(exc, MissingDependency):
        return MISSING_EXTRA
    if isinstance(exc, (ConfigError, KeyParseError)):
        return USAGE
    if isinstance(exc, StoreError):
        return STORE_UNAVAILABLE
    if isinstance(exc, FormatError):
        return BAD_CHUNK
    return FAILURE
