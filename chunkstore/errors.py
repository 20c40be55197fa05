"""The one exception hierarchy of chunkstore.

Every error the library raises on purpose derives from :class:`ChunkStoreError`.
Everything a decoder can say about bad bytes is a :class:`FormatError` subclass.
So callers on the serving path can treat ``except FormatError`` as "this chunk is a miss".
They never catch programming errors by accident.
"""

from __future__ import annotations


class ChunkStoreError(Exception):
    """Base class of every error chunkstore raises on purpose."""


class ConfigError(ChunkStoreError, ValueError):
    """An option, URL or argument given by the user is invalid."""


class MissingDependency(ChunkStoreError, ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


class StoreError(ChunkStoreError):
    """A store could not be opened or used.
    Examples are bad credentials, a missing bucket, and an unreadable root."""


class KeyParseError(ChunkStoreError, ValueError):
    """Text that should be a chunk key is not 64 lower-case hex digits."""


# --- format -----------------------------------------------------------------


class FormatError(ChunkStoreError):
    """The bytes are not a valid chunk. Subclasses say which check failed."""


class TruncatedChunk(FormatError):
    """The input ends before the header or payload it announces."""


class BadMagic(FormatError):
    """The input does not start like a chunkstore chunk. It is a foreign or empty file."""


class HeaderTooLarge(FormatError):
    """The announced header length exceeds the reader's limit."""


class MalformedHeader(FormatError):
    """The header is not the JSON document the spec requires, or a field is invalid."""


class UnsupportedVersion(FormatError):
    """The chunk needs a newer reader: valid for its writer, a plain miss for this one.

    Raised for an unknown major version.
    The subclasses below are raised for what a later minor of a known major may add.
    This is never damage.
    Stores and tools must not quarantine or delete such a chunk, see spec/FORMAT.md section 2.
    """


class UnsupportedFeature(UnsupportedVersion):
    """A chunk of a newer minor version uses something this reader does not know."""


class UnknownDType(UnsupportedFeature):
    """A tensor dtype this reader does not know, in a chunk of a newer minor version."""


class UnknownCompression(UnsupportedFeature):
    """A payload compression this reader does not know, in a chunk of a newer minor version."""


class LayoutError(FormatError):
    """Tensor offsets leave holes, overlap, or disagree with dtypes and shapes."""


class ChecksumMismatch(FormatError):
    """The stored checksum does not match header and payload: the bytes were damaged."""


class KeyMismatch(FormatError):
    """The chunk key is not BLAKE3(parent || tokens), or not the key that was asked for."""


class AuthenticationError(FormatError):
    """The chunk lacks a valid MAC for the reader's secret key."""


class SpecMismatch(FormatError):
    """The chunk was written for another model fingerprint or KV description."""


class CompressionError(FormatError):
    """The compressed payload cannot be decompressed to the announced size."""
