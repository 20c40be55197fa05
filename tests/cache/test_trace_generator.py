"""The seeded trace generator: determinism, Mooncake format, and the structure of each workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkstore.cli.main import main
from chunkstore.errors import ConfigError
from chunkstore.simulator import load_trace, simulate
from chunkstore.simulator.generate import WORKLOADS, generate_trace, write_trace


def shares(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common leading run of two block-id lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_same_seed_same_trace_and_mooncake_shape(workload: str, tmp_path: Path) -> None:
    first = generate_trace(workload, requests=150, seed=3)
    assert first == generate_trace(workload, requests=150, seed=3)
    assert first != generate_trace(workload, requests=150, seed=4)
    assert len(first) == 150
    stamps = [r.timestamp for r in first]
    assert stamps == sorted(stamps)
    for request in first:
        # One id per started block of 512 tokens, like the Mooncake traces.
        assert len(request.hash_ids) == -(-request.input_length // 512)
        assert request.output_length > 0
    path = write_trace(first, tmp_path / "t.jsonl")
    line = json.loads(path.read_text().splitlines()[0])
    assert set(line) == {"timestamp", "input_length", "output_length", "hash_ids"}
    trace = load_trace(path)
    # The reader keeps the full blocks, as the engine does: not a partial last one.
    full = [r.hash_ids[: r.input_length // 512] for r in first]
    assert [r.blocks for r in trace.requests] == full
    assert any(len(f) < len(r.hash_ids) for f, r in zip(full, first, strict=True))


def test_block_ids_are_prefix_chained() -> None:
    # Equal ids mean equal prefixes: an id never follows two different parents.
    for workload in WORKLOADS:
        parent_of: dict[int, int] = {}
        for request in generate_trace(workload, requests=200, seed=1):
            parent = -1
            for block in request.hash_ids:
                assert parent_of.setdefault(block, parent) == parent, workload
                parent = block


def test_chat_turns_extend_their_conversation() -> None:
    # A turn re-sends the conversation: its prompt starts with every full block of an
    # earlier request (the previous turn), and comes later by a think time.
    requests = generate_trace("chat", requests=300, seed=2)
    extended = 0
    for i, request in enumerate(requests):
        for earlier in requests[:i]:
            full = earlier.input_length // 512
            if full > 4 and shares(earlier.hash_ids, request.hash_ids) >= full:
                assert request.timestamp > earlier.timestamp
                extended += 1
                break
    assert extended > 50


def test_system_prompts_are_shared_by_many_conversations() -> None:
    requests = generate_trace("system-prompts", requests=400, seed=0)
    first_blocks = [r.hash_ids[0] for r in requests]
    # At most 8 system prompts open every prompt; the most popular one opens many.
    assert len(set(first_blocks)) <= 8
    assert max(first_blocks.count(b) for b in set(first_blocks)) > 100


def test_rag_documents_have_skewed_popularity() -> None:
    requests = generate_trace("rag", requests=600, seed=0)
    # Blocks right after the shared system prompt open the first document: a few are hot.
    openers = [r.hash_ids[2] for r in requests if len(r.hash_ids) > 2]
    counts = sorted((openers.count(b) for b in set(openers)), reverse=True)
    assert counts[0] > 10 * counts[len(counts) // 2]


def test_agent_transcripts_grow_step_by_step() -> None:
    requests = generate_trace("agent", requests=200, seed=0)
    tools = {r.hash_ids[0] for r in requests}
    assert len(tools) <= 3
    grown = sum(
        1
        for i, request in enumerate(requests)
        if any(
            len(request.hash_ids) > len(e.hash_ids) > 6
            and shares(e.hash_ids, request.hash_ids) >= e.input_length // 512
            for e in requests[max(0, i - 40) : i]
        )
    )
    assert grown > 100


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="unknown workload 'web'"):
        generate_trace("web")
    with pytest.raises(ConfigError, match="at least 1 request"):
        generate_trace("chat", requests=0)
    with pytest.raises(ConfigError, match="block_tokens"):
        generate_trace("chat", block_tokens=0)


def test_gen_trace_cli_feeds_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "agent.jsonl"
    assert main(["gen-trace", "agent", "--requests", "60", "--seed", "5", "-o", str(path)]) == 0
    assert "wrote 60 agent requests" in capsys.readouterr().out
    assert main(["simulate", str(path), "--capacities", "20", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["requests"] == 60
    assert {r["policy"] for r in document["results"]} == {"parc", "arc", "lru", "belady"}
    trace = load_trace(path)
    assert simulate(trace, [20]).result("belady", 20).hits > 0
    assert main(["gen-trace", "chat", "-o", str(tmp_path / "missing" / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write trace" in err
    with pytest.raises(SystemExit):
        main(["gen-trace", "--help"])
    assert "system-prompts" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--requests", "1" + "0" * 400], "--requests"),
        (["--requests", "10000001"], "--requests"),
        (["--requests", "0"], "--requests"),
        (["--block-tokens", "-1"], "--block-tokens"),
    ],
)
def test_out_of_range_options_are_one_line_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], option: str
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", "chat", "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and option in err and len(err) < 200
    assert not out.exists()
