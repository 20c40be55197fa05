"""Fault injection for local stores: one path whose I/O the OS refuses."""

from __future__ import annotations

import errno
from typing import Any

import pytest

from chunkstore.backends import _fsio

EIO = OSError(errno.EIO, "Input/output error")
"""A failing disk sector (or ESTALE on NFS): the read fails, the file is still there."""
EACCES = PermissionError(errno.EACCES, "Permission denied")
"""An operator without write permission on a fan-out directory."""


def fail_on_path(monkeypatch: pytest.MonkeyPatch, method: str, path: str, error: OSError) -> None:
    """Make ``LocalIO.<method>`` raise ``error`` for ``path`` (first argument) only."""
    real = getattr(_fsio.LocalIO, method)

    def faulty(self: _fsio.LocalIO, target: str, *args: Any) -> Any:
        if target == path:
            raise type(error)(error.errno, error.strerror, target)
        return real(self, target, *args)

    monkeypatch.setattr(_fsio.LocalIO, method, faulty)
