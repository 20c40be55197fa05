"""``chunkstore serve --node``: a bad option is one line naming the flag, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.cli.main import main
from tests.node.conftest import Node


def _serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", *args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--node", "relative/node.sock"], "--node: the node socket path must be absolute"),
        (["--node", "tcp://127.0.0.1:1"], "--node: a node address is unix:///path"),
        (["--node", "/no/such/dir/node.sock"], "--node /no/such/dir/node.sock: directory"),
        (["--node-secret-env", "X"], "--node-secret-env needs --node"),
        (["--node-events", "ipc:///tmp/x"], "--node-events needs --node"),
        (["--node-events-replay", "ipc:///tmp/x"], "--node-events-replay needs --node-events"),
        (["--node-events-topic", "t"], "--node-events-topic needs --node-events"),
    ],
)
def test_bad_node_options_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    rc, err = _serve(capsys, *args)
    assert rc != 0 and says in err and err.count("\n") == 1


def test_a_live_service_on_the_path_is_not_replaced(
    capsys: pytest.CaptureFixture[str], node: Node, tmp_path: Path
) -> None:
    rc, err = _serve(capsys, "--node", node.socket)
    assert rc == 2 and "another node service is running there" in err
    assert node.server.stats()["sessions"] == 0  # the live one kept serving, untouched
