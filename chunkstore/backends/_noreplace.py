"""A rename that never replaces: Linux's ``renameat2`` with ``RENAME_NOREPLACE``.

Put-if-absent needs a publish that fails when the name is taken. A hard link then
removing the temp name does that in two metadata operations. This is one, the same cost
as a plain rename. On a network filesystem each operation is a round trip to its
metadata server.

Python's ``os`` has no such call, so it comes from the C library through ctypes. Kernels,
C libraries and filesystems without it answer None, and the caller links instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Any

RENAME_NOREPLACE = 1
"""The flag of ``renameat2`` that refuses an existing target (linux/fs.h)."""
_AT_FDCWD = -100
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP})
"""Errors that say the call or its flag is not there (this kernel, this filesystem)."""

_call: Any = None
_loaded = False


def _renameat2() -> Any:
    """The C library's ``renameat2`` (None: not Linux, or glibc older than 2.28)."""
    global _call, _loaded
    if not _loaded:
        _loaded = True
        if sys.platform.startswith("linux"):
            try:
                call = ctypes.CDLL(None, use_errno=True).renameat2
            except (AttributeError, OSError):
                call = None
            if call is not None:
                call.argtypes = [
                    ctypes.c_int,
                    ctypes.c_char_p,
                    ctypes.c_int,
                    ctypes.c_char_p,
                    ctypes.c_uint,
                ]
                call.restype = ctypes.c_int
            _call = call
    return _call


def rename_noreplace(src: str, dst: str) -> bool | None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists.

    True: renamed. False: ``dst`` exists, and ``src`` is left where it was. None: this
    system or filesystem has no such rename, and nothing changed. Any other failure
    raises :class:`OSError` as :func:`os.rename` would.
    """
    call = _renameat2()
    if call is None:
        return None
    if call(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    if code in _UNSUPPORTED:
        return None
    raise OSError(code, os.strerror(code), src, None, dst)
