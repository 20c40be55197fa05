"""Judging stored bytes: ok, corrupt, or written by a format version this reader lacks.

``verify`` and ``cp`` both need the distinction: a chunk of an unknown major
version, or of a newer minor using a dtype or compression this reader lacks (a
newer writer during a rolling upgrade), is not damage and must not be
quarantined or deleted, only reported (spec/FORMAT.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkstore.hashing import ChunkKey

# ReadVerdict's values (a test checks it), spelled out here so that the CLI starts without
# importing the backends.
OK = "ok"
CORRUPT = "corrupt"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What decoding one stored chunk said."""

    status: str
    """``ok``, ``corrupt`` or ``unsupported``."""
    problem: str = ""
    """``ErrorClass: message`` when not ok."""


def judge(data: Any, key: ChunkKey) -> Verdict:
    """Decode with checksum verification and check the key and namespace it was stored under."""
    from chunkstore.backends.base import ReadVerdict
    from chunkstore.backends.base import judge as judge_read

    # The serving path's rule decides: a newer writer's chunk is reported, never damage.
    judged = judge_read(key, data)
    if judged.error is not None:
        unsupported = judged.verdict is ReadVerdict.UNSUPPORTED
        problem = f"{type(judged.error).__name__}: {judged.error}"
        return Verdict(UNSUPPORTED if unsupported else CORRUPT, problem)
    header = judged.header  # judge_read hands the header of every chunk it passes
    if header is not None and header.namespace != key.namespace:
        return Verdict(
            CORRUPT,
            f"NamespaceMismatch: chunk of namespace {header.namespace} "
            f"stored under {key.namespace}",
        )
    return Verdict(OK)
