"""README.md and the manual in docs/ stay true.

README's Python example and the Python API page's run; every metric (with its labels), peer
`stats` field and counter, CLI command and flag, connector option and store, cache and peer
option is on its page, and nothing documented there is gone; every `make` target, `chunkstore`
command and repository path shown exists, with the flags shown; README.md stays a README
(short, every link inside the repository). `mkdocs build --strict` (in `make test`) checks the
site's links, anchors and navigation.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200
STORE_COMMANDS = ("ls", "inspect", "show", "verify", "prune", "cp")

# Fenced blocks (language, body) and inline code spans.
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# A shell line invoking make or chunkstore: at the start, after a prompt, or after `&&`/`;`/`|`,
# optionally behind VAR=value assignments and a path to the executable.
MAKE = re.compile(r"(?:^|\$ |&& |; )(?:[A-Z_]+=\S* )*make ((?:[a-z][\w-]* ?)+)")
CLI = re.compile(r"(?:^|\$ |&& |; |\| )(?:\S*/)?chunkstore ([a-z][\w-]*)([^|;#&>]*)")


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def _documents() -> Iterator[tuple[str, str]]:
    yield "README.md", README.read_text()
    for path in sorted(DOCS.rglob("*.md")):
        yield str(path.relative_to(ROOT)), path.read_text()


def _shell_lines(text: str) -> Iterator[str]:
    """Lines of every non-Python code block (continuations joined), then every inline span."""
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            yield from match.group(2).replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    yield from (span.strip() for span in INLINE.findall(prose))


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    assert isinstance(action, argparse._SubParsersAction)
    return dict(action.choices)


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", makefile, re.M))


def test_python_api_example_runs() -> None:
    block = re.search(r"```python\n(.*?)```", _page("python-api.md"), re.S)
    assert block is not None
    exec(compile(block.group(1), "docs/python-api.md", "exec"), {})


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's Python example runs as shown (its store is a directory under the cwd)."""
    blocks = [body for lang, body in FENCE.findall(README.read_text()) if lang == "python"]
    assert len(blocks) == 1, "README.md should have one short Python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert list(tmp_path.rglob("*.kvc")), "README's example stored no chunk"


def test_every_metric_is_documented() -> None:
    names = set()
    for path in (ROOT / "chunkstore").rglob("*.py"):
        names |= set(re.findall(r"[\"'](chunkstore_[a-z_]+)[\"']", path.read_text()))
    assert len(names) >= 20
    page = _page("metrics.md")
    missing = sorted(n for n in names if f"`{n}" not in page)
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"


def test_every_documented_metric_exists() -> None:
    code = "\n".join(p.read_text() for p in (ROOT / "chunkstore").rglob("*.py"))
    registered = set(re.findall(r"[\"'](chunkstore_[a-z_]+)[\"']", code))
    # A counter is registered without `_total` (prometheus-client adds it on export).
    known = registered | {f"{n}_total" for n in registered}
    documented = set(re.findall(r"`(chunkstore_[a-z_]+)", _page("metrics.md")))
    gone = sorted(n for n in documented if n not in known and not n.endswith("_"))
    assert not gone, f"docs/metrics.md names metrics the code no longer has: {gone}"


def test_metric_labels_shown_anywhere_exist() -> None:
    """``chunkstore_x{label="..."}`` on any page names a metric and labels the code has."""
    labels = dict(_registered_metrics())
    # Metrics a collector reports at scrape time have no object to ask; their names are
    # checked against the code's text, their labels against metrics.md's table.
    code = "\n".join(p.read_text() for p in (ROOT / "chunkstore").rglob("*.py"))
    wrong = []
    for name, text in _documents():
        for metric, shown in re.findall(r"(chunkstore_[a-z_]+)\{([^}]*)\}", text):
            names = {part.split("=")[0].strip() for part in shown.split(",")}
            if metric in labels:
                ok = names <= set(labels[metric])
            else:
                ok = f'"{metric.removesuffix("_total")}"' in code
            if not ok:
                wrong.append(f"{name}: {metric}{{{shown}}}")
    assert not wrong, f"metrics shown with labels the code does not have: {wrong}"


def _registered_metrics() -> Iterator[tuple[str, tuple[str, ...]]]:
    """(exported name, label names) of every metric object the metric holders create."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import Counter, MetricWrapperBase

    from chunkstore.metrics import ChunkstoreMetrics
    from chunkstore.peer._metrics import PeerMetrics

    for holder in (ChunkstoreMetrics(CollectorRegistry()), PeerMetrics(CollectorRegistry())):
        for metric in vars(holder).values():
            if isinstance(metric, MetricWrapperBase):
                suffix = "_total" if isinstance(metric, Counter) else ""
                yield metric._name + suffix, tuple(metric._labelnames)


def test_every_metric_is_documented_with_its_labels() -> None:
    page = _page("metrics.md")
    wrong = []
    for name, labels in _registered_metrics():
        row = re.search(rf"^\| `{name}` \| \w+ \| ([^|]*) \|", page, re.M)
        braces = re.search(rf"`{name}\{{([^}}]*)\}}`", page)
        if row is not None:
            shown = tuple(label.strip() for label in row.group(1).split(",") if label.strip())
        elif braces is not None:
            shown = tuple(label.strip() for label in braces.group(1).split(","))
        else:
            wrong.append(f"{name}: no table row or {name}{{labels}}")
            continue
        if shown != labels:
            wrong.append(f"{name}: documented labels {shown}, registered {labels}")
    assert not wrong, "\n".join(wrong)


def test_peer_server_stats_are_documented() -> None:
    """Every field of a peer server's ``stats`` and every counter it keeps is on the page."""
    peer = ROOT / "chunkstore" / "peer"
    tree = ast.parse((peer / "_server.py").read_text())
    stats = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "stats"
    )
    # The keys of the dict it builds and of the items it sets: every string constant in it.
    fields = {
        node.value
        for node in ast.walk(stats)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.isidentifier()
    }
    counters = set()
    for path in peer.glob("*.py"):
        counters |= set(re.findall(r"\.count\(f?[\"']([a-z_]+)", path.read_text()))
    assert {"inline_pins", "counts"} <= fields and "replies_dropped" in counters
    page = _page("metrics.md")
    missing = sorted(n for n in fields | counters if f"`{n}" not in page)
    assert not missing, f"stats fields or counters missing from docs/metrics.md: {missing}"


def test_vllm_connector_counters_are_documented() -> None:
    from chunkstore.vllm.counters import COUNTERS

    page = _page("metrics.md")
    missing = sorted(n for n in COUNTERS if f"`vllm:chunkstore_{n}_total`" not in page)
    assert not missing, f"vllm:chunkstore_* counters missing from docs/metrics.md: {missing}"


def test_every_cli_flag_is_documented() -> None:
    """The store commands' flags are on docs/cli.md; the others' on the page of their part."""
    cli_page = _page("cli.md")
    manual = "\n".join(path.read_text() for path in DOCS.glob("*.md"))
    missing = []
    for command, parser in _subcommands().items():
        text = cli_page if command in STORE_COMMANDS else manual
        for action in parser._actions:
            flags = [f for f in action.option_strings if f not in ("-h", "--help")]
            if flags and not any(re.search(rf"`[^`]*(?<![\w-]){f}(?![\w-])", text) for f in flags):
                missing.append(f"chunkstore {command} {'/'.join(flags)}")
    assert not missing, f"flags missing from the manual: {missing}"


def _keyword_options(function: Callable[..., Any], *skip: str) -> list[str]:
    return [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in skip
    ]


def test_every_store_cache_and_peer_option_is_documented() -> None:
    """Every keyword option of the stores, caches and peers is named in code on its page."""
    from chunkstore.backends._fs import FsStore
    from chunkstore.cache import HostCache
    from chunkstore.cache.assembly._assembler import ShardAssembler
    from chunkstore.cache.assembly._owner import AssemblyOwner
    from chunkstore.tiering import TieredStore

    pages: dict[str, list[str]] = {
        "stores.md": _keyword_options(FsStore.__init__, "fs"),
        "cache.md": [
            *_keyword_options(HostCache.__init__),
            *_keyword_options(TieredStore.__init__, "clock"),
            *_keyword_options(AssemblyOwner.__init__, "clock"),
            *_keyword_options(ShardAssembler.__init__),
        ],
    }
    if importlib.util.find_spec("s3fs") is not None:
        from chunkstore.backends._s3 import S3Store

        pages["stores.md"] += _keyword_options(S3Store.__init__)
    if importlib.util.find_spec("zmq") is not None:
        from chunkstore.peer import PeerClientConfig, PeerServerConfig, PeerStore

        pages["peers.md"] = [
            *(f.name for f in dataclasses.fields(PeerServerConfig)),
            *(f.name for f in dataclasses.fields(PeerClientConfig)),
            *_keyword_options(PeerStore.__init__),
        ]
    missing = []
    for page, options in pages.items():
        text = _page(page)
        for option in options:
            if not re.search(rf"`[^`\n]*(?<![\w.]){option}(?!\w)[^`\n]*`", text):
                missing.append(f"docs/{page}: {option}")
    assert not missing, f"options missing from their page: {missing}"


def test_every_cli_command_is_documented() -> None:
    commands = _subcommands()
    assert {
        "ls",
        "inspect",
        "show",
        "verify",
        "prune",
        "cp",
        "demo",
        "serve",
        "simulate",
        "peers",
    } <= set(commands)
    page = _page("cli.md")
    missing = sorted(c for c in commands if f"`chunkstore {c}" not in page)
    assert not missing, f"commands missing from the table in docs/cli.md: {missing}"


def test_every_connector_option_is_documented() -> None:
    config = pytest.importorskip("chunkstore.vllm.config")
    page = _page("vllm.md")
    missing = sorted(o for o in config.OPTIONS if f"`{o}`" not in page)
    assert not missing, f"connector options missing from docs/vllm.md: {missing}"


def test_make_targets_shown_exist() -> None:
    targets = _make_targets()
    shown: dict[str, str] = {}
    for name, text in _documents():
        for line in _shell_lines(text):
            for match in MAKE.finditer(line):
                for target in match.group(1).split():
                    shown.setdefault(target, name)
    assert {"demo", "test", "bench"} <= set(shown)
    unknown = sorted(f"make {t} ({where})" for t, where in shown.items() if t not in targets)
    assert not unknown, f"make targets shown but not in the Makefile: {unknown}"


def test_cli_commands_shown_exist_with_their_flags() -> None:
    commands = _subcommands()
    problems = []
    seen = set()
    for name, text in _documents():
        for line in _shell_lines(text):
            for match in CLI.finditer(line):
                command, rest = match.groups()
                seen.add(command)
                if command not in commands:
                    problems.append(f"{name}: chunkstore {command} (no such command)")
                    continue
                known = commands[command]._option_string_actions
                for flag, wildcard in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)(\*?)", rest):
                    # `--peer-*` stands for a family of flags: some flag must start with it.
                    if flag not in known and not (
                        wildcard and any(k.startswith(flag) for k in known)
                    ):
                        problems.append(f"{name}: chunkstore {command} {flag} (no such flag)")
    assert {"ls", "inspect", "show", "verify", "prune", "cp", "serve", "simulate"} <= seen
    assert not problems, "\n".join(problems)


def test_repository_paths_shown_exist() -> None:
    """Every file of the repository the manual names (``tests/cli/test_ls.py``, ``tools/...``,
    ``chunkstore/tiering/_guard.py``, ``spec/vectors/``) is there."""
    path = re.compile(r"(?<![\w/.~-])((?:chunkstore|tests|tools|spec|docs)/[\w/.*-]*(?:\.\w+|/))")
    missing = []
    for name, text in _documents():
        for shown in set(path.findall(text)):
            found = list(ROOT.glob(shown)) if "*" in shown else [ROOT / shown]
            if not any(p.exists() for p in found):
                missing.append(f"{name}: {shown}")
    assert not missing, f"paths named in the manual that do not exist: {sorted(missing)}"


def test_readme_is_short_and_links_stay_in_the_repository() -> None:
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the manual belongs in docs/"
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"(?:src|href)=\"([^\"]+)\"", text)
    assert links
    headings = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", text), re.M)}
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        if not target:
            assert anchor in headings, f"README.md links #{anchor}, which is no heading"
            continue
        path = (ROOT / target).resolve()
        assert path.is_relative_to(ROOT), f"README.md links {link}, outside the repository"
        assert path.exists(), f"README.md links {link}, which does not exist"


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_vllm_example_is_the_documented_one() -> None:
    blocks = [b for lang, b in FENCE.findall(README.read_text()) if "vllm serve" in b]
    assert len(blocks) == 1
    assert blocks[0] in _page("vllm.md"), "README's vllm serve example differs from docs/vllm.md"
