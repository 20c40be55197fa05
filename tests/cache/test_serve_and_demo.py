"""``chunkstore serve`` (a real process, scraped over HTTP) and the tiered demo."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkstore.cli.commands import serve
from chunkstore.cli.main import build_parser, main
from chunkstore.tiering._demo import run_tiered_demo


@pytest.mark.slow
def test_serve_exposes_metrics_and_stops_cleanly(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "chunkstore.cli.main",
        "serve",
        "--slot-size",
        "64KiB",
        "--host-cache",
        "1MiB",
        "--store",
        str(tmp_path / "disk"),
        "--create",
        "--metrics-port",
        "0",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        metrics_line = process.stdout.readline()
        assert metrics_line.startswith("metrics: http://127.0.0.1:"), metrics_line
        serving = process.stdout.readline()
        assert "16 slots of 64.0 KiB, parc" in serving and "tiers: fs" in serving
        with urllib.request.urlopen(metrics_line.split()[1], timeout=10) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        capacity = families["chunkstore_host_cache_bytes_capacity"].samples[0]
        assert capacity.labels == {"tier": "host"} and capacity.value == 1 << 20
        assert families["chunkstore_tier_up"].samples[0].labels == {"tier": "fs"}
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
        assert process.returncode == 0, err
        assert "stopping" in out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_serve_runs_added_services(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def add(parser: object) -> None:
        parser.add_argument("--extra-port", type=int, default=None)  # type: ignore[attr-defined]

    def start(context: serve.ServeContext) -> serve.Stop:
        seen["port"] = context.args.extra_port
        seen["host_slots"] = context.store.host.num_slots
        return lambda: seen.setdefault("stopped", True)

    monkeypatch.setattr(serve, "SERVICES", [*serve.SERVICES, serve.Service("extra", add, start)])
    args = build_parser().parse_args(
        ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", "--extra-port", "7"]
    )
    stop = threading.Event()
    stop.set()
    assert serve.run(args, stop_event=stop) == 0
    assert seen == {"port": 7, "host_slots": 16, "stopped": True}


def test_serve_option_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "--host-cache", "1MiB"]) == 2
    assert "--slot-size or --spec" in capsys.readouterr().err
    assert main(["serve", "--slot-size", "2MiB", "--host-cache", "1MiB"]) == 2
    assert "smaller than one chunk" in capsys.readouterr().err
    spec = tmp_path / "spec.json"
    spec.write_text('{"model_id": "x", "dtype": "BF16", "chunk_tokens": 16, "groups": []}')
    assert main(["serve", "--spec", str(spec)]) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--metrics-port", "70000"], "--metrics-port must be a TCP port in 0..65535"),
        (["--metrics-port", "-1"], "--metrics-port must be a TCP port in 0..65535"),
        (["--queue-size", "0"], "--queue-size must be at least 1"),
        (["--tier-timeout", "0"], "--tier-timeout must be a number of seconds > 0"),
        (["--tier-timeout", "inf"], "--tier-timeout must be a number of seconds > 0"),
        (["--retry-after", "-1"], "--retry-after must be a number of seconds >= 0"),
    ],
)
def test_serve_rejects_bad_numbers_naming_the_flag(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --metrics-port 0 comes first where valid: a half-started serve would have printed its URL
    metrics = [] if "--metrics-port" in options else ["--metrics-port", "0"]
    assert main(["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", *metrics, *options]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1, (out, err)


def test_serve_never_creates_a_mistyped_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "mnt" / "kv-typo"
    base = ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", "--store", str(typo)]
    assert main([*base, "--metrics-port", "0"]) == 4
    out, err = capsys.readouterr()
    assert out == "" and "no such directory" in err and "--create" in err
    assert not typo.exists() and not typo.parent.exists()
    stop = threading.Event()
    stop.set()
    assert serve.run(build_parser().parse_args([*base, "--create"]), stop_event=stop) == 0
    assert typo.is_dir()  # made on request
    assert "tiers: fs" in capsys.readouterr().out
    # and an existing store opens without --create
    assert serve.run(build_parser().parse_args(base), stop_event=stop) == 0


def test_serve_help_documents_create(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--create" in text and "must exist unless --create is given" in text


def test_tiered_demo_hits_every_tier(tmp_path: Path) -> None:
    lines: list[str] = []
    report = run_tiered_demo("memory://", lines.append)
    assert report.working_set > report.host_slots
    assert report.computed == report.working_set  # every chunk computed once, then reused
    assert report.host_hits > 0 and report.store_hits > 0
    assert report.promotions == report.store_hits and report.writes_dropped == 0
    assert any("promotions" in line for line in lines)
    first = sum(t[4] for t in report.turns)
    assert first == report.computed
