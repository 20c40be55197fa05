"""The node service's unix socket: created owner-only, atomically, and removed by its owner.

ZeroMQ creates an ``ipc://`` socket file with the process umask.
A chmod afterwards leaves a window in which anyone could connect.
So the socket is bound inside a fresh private directory, mode 0700, next to the wanted path.
It is made 0600 there, and renamed into place.
It is never reachable with wider permissions.
A socket file left by a killed service is replaced.
One that a live service still answers on is refused.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.errors import ConfigError
from chunkstore.units import shown

MAX_SOCKET_PATH = 107
"""Longest unix socket path (``sun_path`` is 108 bytes with its terminating NUL)."""


@dataclass(frozen=True, slots=True)
class BoundSocket:
    """A unix socket this process bound and must remove."""

    path: Path
    """Where clients connect."""
    inode: int
    """The socket file's inode: removed on close only while it is still ours."""

    def remove(self) -> None:
        """Remove the socket file unless another service has replaced it meanwhile."""
        try:
            if os.stat(self.path).st_ino == self.inode:
                self.path.unlink()
        except FileNotFoundError:
            pass


def socket_path(endpoint: str) -> Path:
    """The file of an ``ipc://`` endpoint. Raises ConfigError for anything else."""
    if not endpoint.startswith("ipc://") or not endpoint.removeprefix("ipc://"):
        raise ConfigError(f"a node socket is an ipc:// path, got {shown(endpoint)}")
    path = Path(endpoint.removeprefix("ipc://"))
    if not path.is_absolute():
        raise ConfigError(f"the node socket path must be absolute, got {shown(str(path))}")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"the node socket path {shown(str(path))} is longer than {MAX_SOCKET_PATH} bytes"
        )
    return path


def answers(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Non-blocking: a frozen service (stopped, paused container) whose listen backlog is full
    # answers EAGAIN at once, where a blocking connect would wait for ever (holding the
    # engine's client lock). A unix socket's connect completes at once when it is queued.
    probe.setblocking(False)
    try:
        probe.connect(os.fspath(path))
    except OSError:  # (BlockingIOError included: it does not accept connections now)
        return False
    finally:
        probe.close()
    return True


def bind_owner_only(router: Any, endpoint: str) -> BoundSocket:
    """Bind the ZeroMQ socket ``router`` to ``endpoint`` (``ipc://PATH``) with mode 0600."""
    path = socket_path(endpoint)
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot serve on {path}: directory {parent} does not exist")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"cannot serve on {path}: it exists and is not a socket")
        if answers(path):
            raise ConfigError(f"cannot serve on {path}: another node service is running there")
    try:
        private = Path(tempfile.mkdtemp(prefix=".cs-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"cannot serve on {path}: {exc.strerror}") from None
    staged = private / "s"
    try:
        if len(os.fsencode(staged)) > MAX_SOCKET_PATH:
            raise ConfigError(f"the node socket directory {parent} has too long a path")
        router.bind(f"ipc://{staged}")
        os.chmod(staged, 0o600)
        os.rename(staged, path)
    finally:
        staged.unlink(missing_ok=True)
        private.rmdir()
    return BoundSocket(path, os.stat(path).st_ino)


__all__ = ["BoundSocket", "answers", "bind_owner_only", "socket_path"]
