"""The trace simulator: known answers on small traces, bad traces, the shared Mooncake trace."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from chunkstore.cli.main import main
from chunkstore.simulator import (
    Trace,
    TraceError,
    TraceRequest,
    belady_hits,
    default_capacities,
    load_trace,
    next_uses,
    parse_trace,
    simulate,
)

SHARED_TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)


def exit_code(argv: list[str]) -> int:
    """``chunkstore ARGV``'s exit status (argparse's own errors exit from inside main)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def mooncake(*requests: list[int], input_length: int | None = None) -> list[str]:
    return [
        json.dumps(
            {
                "timestamp": i,
                "input_length": input_length or 512 * len(ids),
                "output_length": 1,
                "hash_ids": ids,
            }
        )
        for i, ids in enumerate(requests)
    ]


def test_known_answers_on_a_small_trace() -> None:
    # Accesses: 1 2 3 | 1 2 4 | 1 2 3, capacity 3.
    trace = parse_trace(mooncake([1, 2, 3], [1, 2, 4], [1, 2, 3]))
    assert (trace.accesses, trace.unique_blocks, trace.input_tokens) == (9, 4, 9 * 512)
    result = simulate(trace, [3])
    lru, arc, opt = (result.result(p, 3) for p in ("lru", "arc", "belady"))
    # LRU: misses 1 2 3; hits 1 2; 4 evicts 3; hits 1 2; 3 evicts 4 -> 4 hits.
    assert (lru.hits, lru.tokens_saved) == (4, 4 * 512)
    # ARC: 1 and 2 move to T2 on their second use; 4 evicts 3 (T1's LRU), 3 evicts 4 -> 4 hits.
    assert (arc.hits, arc.tokens_saved) == (4, 4 * 512)
    # Belady: demand paging must admit 4 (never reused); it evicts the resident used farthest
    # ahead, 3 (position 8, vs 1 at 6 and 2 at 7); 3 then evicts 4 -> also 4 hits.
    assert opt.hits == 4
    assert lru.hit_ratio == pytest.approx(4 / 9)


def test_belady_beats_lru_where_it_should() -> None:
    # Cyclic scan over 4 blocks with 3 slots: LRU never hits. MIN (next uses in brackets):
    # 1 2 3 miss; 4 evicts 3 [1:4 2:5 3:6]; 1 2 hit; 3 evicts 2 [1:8 2:9 4:7]; 4 1 hit;
    # 2 evicts 1 [4:11 1:never 3:10]; 3 4 hit -> 6 hits.
    cycle = [1, 2, 3, 4] * 3
    trace = parse_trace(mooncake(cycle))
    result = simulate(trace, [3])
    assert result.result("lru", 3).hits == 0
    assert result.result("belady", 3).hits == sum(belady_hits(cycle, 3)) == 6
    assert next_uses([1, 2, 1, 3]) == [2, 4, 4, 4]


def test_tokens_saved_counts_leading_hits_only() -> None:
    # Second request: block 1 hits, 9 misses, 2 hits -> only the first block's tokens are saved.
    trace = parse_trace(mooncake([1, 2], [1, 9, 2], input_length=1536))
    entry = simulate(trace, [10], ["lru"]).result("lru", 10)
    assert entry.hits == 2
    assert entry.tokens_saved == 512
    # A request built by hand with more blocks than its prompt fills: saved tokens are
    # capped by the prompt length.
    short = (TraceRequest(0, 100, 1, (5,)), TraceRequest(1, 100, 1, (5,)))
    assert simulate(Trace("t", short, 512), [1], ["arc"]).result("arc", 1).tokens_saved == 100


def test_partial_last_mooncake_block_is_neither_hit_nor_admitted() -> None:
    # Every prompt is 2 full blocks plus 76 tokens; the partial block's id 99 repeats.
    trace = parse_trace(mooncake([1, 2, 99], [1, 2, 99], [1, 2, 99], input_length=1100))
    assert [r.blocks for r in trace.requests] == [(1, 2)] * 3
    assert (trace.accesses, trace.unique_blocks, trace.input_tokens) == (6, 2, 3300)
    result = simulate(trace, [2])
    for policy in result.policies:
        entry = result.result(policy, 2)
        # Admitting 99 would evict 1 or 2 from 2 slots; the 76 tail tokens are recomputed.
        assert (entry.accesses, entry.hits, entry.tokens_saved) == (6, 4, 4 * 512), policy
    # Fewer hash ids than full blocks: all are kept, the tokens past them are recomputed.
    trace = parse_trace(mooncake([1, 2], [1, 2], input_length=5 * 512))
    assert [r.blocks for r in trace.requests] == [(1, 2)] * 2
    assert simulate(trace, [4], ["lru"]).result("lru", 4).tokens_saved == 1024


def test_token_and_mooncake_traces_agree() -> None:
    # The same prompts as token lists and as Mooncake lines (one hash id per started block,
    # the partial last one included, as the published traces have it) give the same results.
    rng = random.Random(7)
    segments = [[rng.randrange(50_000) for _ in range(rng.randrange(5, 90))] for _ in range(6)]
    prompts = []
    for _ in range(40):
        prompt = [t for i in rng.sample(range(6), rng.randrange(1, 4)) for t in segments[i]]
        prompts.append(prompt + [rng.randrange(50_000) for _ in range(rng.randrange(0, 40))])
    tokens = parse_trace([json.dumps({"tokens": p}) for p in prompts], block_tokens=32)
    ids: dict[object, int] = {}
    lines = []
    for prompt, request in zip(prompts, tokens.requests, strict=True):
        hash_ids = [ids.setdefault(key, len(ids)) for key in request.blocks]
        if len(prompt) % 32:
            hash_ids.append(10**6)  # one id for every partial block: reused if looked up
        record = {"timestamp": 0, "input_length": len(prompt), "output_length": 0}
        lines.append(json.dumps({**record, "hash_ids": hash_ids}))
    moon = parse_trace(lines, block_tokens=32)
    assert sum(len(p) % 32 > 0 for p in prompts) > 20
    assert (moon.accesses, moon.unique_blocks) == (tokens.accesses, tokens.unique_blocks)
    capacities = [2, 5, 12]
    ours, theirs = simulate(tokens, capacities), simulate(moon, capacities)
    assert [
        (r.policy, r.capacity, r.hits, r.tokens_saved, r.input_tokens) for r in ours.results
    ] == [(r.policy, r.capacity, r.hits, r.tokens_saved, r.input_tokens) for r in theirs.results]
    assert any(r.tokens_saved for r in ours.results)


def test_token_trace_is_keyed_by_chain_keys() -> None:
    shared = list(range(1000, 1064))
    lines = [json.dumps({"tokens": shared + [1, 2, 3]}), json.dumps({"tokens": shared + [7] * 40})]
    trace = parse_trace(lines, block_tokens=32)
    assert [len(r.blocks) for r in trace.requests] == [2, 3]
    assert trace.requests[0].blocks == trace.requests[1].blocks[:2]
    entry = simulate(trace, [8], ["lru"]).result("lru", 8)
    assert (entry.hits, entry.tokens_saved) == (2, 64)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops',
            "line 2: not valid JSON",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "hash_ids": [1]}',
            "line 1: missing field 'output_length'",
        ),
        ('{"input_length": 5, "hash_ids": [1]}', "missing fields 'timestamp', 'output_length'"),
        (
            '{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [1]}',
            "line 1: 'input_length' must be a non-negative integer",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}',
            "'hash_ids' must be a list of integers",
        ),
        (
            '{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": []}',
            "'timestamp' must be a number",
        ),
        ("[1, 2]", "expected a JSON object"),
        ('{"tokens": [1, -2]}', "'tokens' must be a list of token ids"),
        ('{"tokens": [1], "timestamp": null}', "'timestamp' must be a number"),
    ],
)
def test_bad_traces_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        '{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}\n',
        '{"tokens": [1, 2, 3]}\n{"tokens": []}\n',
        '{"timestamp": 0, "input_length": 511, "output_length": 0, "hash_ids": [7]}\n',
    ],
)
def test_a_trace_without_a_block_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(text)
    for extra in ([], ["--json"]):
        assert main(["simulate", str(trace), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no request has a block" in err


def test_json_nested_past_the_recursion_limit_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tokens": [1]}\n' + "[" * 200_000 + "\n")
    assert main(["simulate", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2: not valid JSON (nested too deeply)" in err


def test_unreadable_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="UTF-8"):
        load_trace(tmp_path / "binary.jsonl")


def test_default_capacities() -> None:
    assert default_capacities(1000) == (10, 20, 50, 100, 200, 300, 500, 750)
    assert default_capacities(3) == (1, 2)


def test_every_host_policy_is_simulated_with_its_gap_to_belady() -> None:
    # Two requests of chain 1-2-3 around a one-off chain 7-8 that does not fit beside it.
    trace = parse_trace(mooncake([1, 2, 3], [7, 8], [1, 2, 3]))
    result = simulate(trace, [3])
    assert result.policies == ("parc", "arc", "lru", "belady")
    # parc: 7 evicts the leaf 3 (walk from 1), 8 evicts 2, then 1; 1 2 3 are all misses again.
    # Belady evicts by next use: 3 for 7 (3 is read last), then 7 itself for 8 -> 1 2 hit.
    opt = result.result("belady", 3)
    assert (opt.hits, opt.tokens_saved) == (2, 1024)
    for policy in ("parc", "arc", "lru"):
        entry = result.result(policy, 3)
        gap = result.gap_to_belady(policy, 3)
        assert gap == pytest.approx(
            (opt.hit_ratio - entry.hit_ratio, opt.tokens_saved_ratio - entry.tokens_saved_ratio)
        )
    assert simulate(trace, [3], ["arc"]).gap_to_belady("arc", 3) is None


def chained(requests: list[list[int]]) -> list[list[int]]:
    """Block ids of prompts given as branch choices: block i's id names its parent and choice,
    so prompts share ids exactly as far as they share choices (a prefix-chained trace)."""
    ids: dict[tuple[int, int], int] = {}
    out = []
    for choices in requests:
        parent, blocks = -1, []
        for choice in choices:
            parent = ids.setdefault((parent, choice), len(ids))
            blocks.append(parent)
        out.append(blocks)
    return out


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=25),
    capacity=st.integers(1, 12),
    short=st.integers(0, 511),
)
def test_belady_hits_bound_every_policys_tokens_saved(
    requests: list[list[int]], capacity: int, short: int
) -> None:
    # Prompts end in a partial block (short tokens fewer than full blocks), dropped.
    assume(short == 0 or any(len(r) > 1 for r in requests))
    lines = [
        json.dumps(
            {
                "timestamp": i,
                "input_length": 512 * len(b) - short,
                "output_length": 1,
                "hash_ids": b,
            }
        )
        for i, b in enumerate(chained(requests))
    ]
    trace = parse_trace(lines)
    result = simulate(trace, [capacity])
    bound = result.tokens_saved_bound(capacity)
    assert bound is not None
    for policy in result.policies:
        assert result.result(policy, capacity).tokens_saved_ratio <= bound + 1e-12
    assert result.result("belady", capacity).tokens_saved_ratio <= bound + 1e-12


def test_min_can_keep_a_chunk_whose_parent_it_evicted() -> None:
    # Why MIN's own tokens saved are no bound: c = 2, chain 1-2-3 twice. Admitting 3, MIN must
    # evict a resident block (3 itself is not a candidate): 2, used after 1. On the second read
    # 1 hits, 2 misses (evicting 1, never used again) and 3 hits: a hit outside the leading run.
    result = simulate(parse_trace(mooncake([1, 2, 3], [1, 2, 3])), [2], ["belady"])
    opt = result.result("belady", 2)
    assert (opt.hits, opt.tokens_saved) == (2, 512)
    assert result.tokens_saved_bound(2) == pytest.approx(1024 / 3072)


def test_parc_keeps_a_usable_prefix_where_arc_keeps_a_useless_tail() -> None:
    # A 4-block conversation comes back after a 2-block one-off, in a cache of 4 blocks:
    # ARC evicts the conversation's head (1, 2) for 8 9; on the second read 1 and 2 miss and
    # evict 3 and 4 before they are read: no hit at all. parc evicts the tail (4, 3), so
    # 1 2 hit and their tokens are saved.
    trace = parse_trace(mooncake([1, 2, 3, 4], [8, 9], [1, 2, 3, 4]))
    result = simulate(trace, [4], ["parc", "arc"])
    arc, parc = result.result("arc", 4), result.result("parc", 4)
    assert (arc.hits, arc.tokens_saved) == (0, 0)
    assert (parc.hits, parc.tokens_saved) == (2, 1024)


def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(mooncake([1, 2, 3], [1, 2, 4], [1, 2, 3])) + "\n")
    plot = tmp_path / "plot.png"
    assert main(["simulate", str(trace), "--capacities", "2,3", "--json", "--plot", str(plot)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["capacities"] == [2, 3] and document["unique_blocks"] == 4
    by_key = {(r["policy"], r["capacity"]): r for r in document["results"]}
    assert by_key[("lru", 3)]["hits"] == 4 and by_key[("belady", 3)]["hits"] == 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert by_key[("arc", 3)]["tokens_saved_gap_to_belady"] == pytest.approx(
        by_key[("belady", 3)]["tokens_saved_ratio"] - by_key[("arc", 3)]["tokens_saved_ratio"]
    )
    assert by_key[("arc", 2)]["tokens_saved_bound"] == pytest.approx(
        min(by_key[("belady", 2)]["hits"] * 512, document["input_tokens"])
        / document["input_tokens"]
    )
    assert main(["simulate", str(trace), "--capacities", "3", "--block-bytes", "1MiB"]) == 0
    text = capsys.readouterr().out
    assert "SAVED GAP" in text and "3.0 MiB" in text
    assert "no policy can save more than (saved%, Belady hits x block size): 3: " in text
    assert "parc saves at least as many tokens as arc and lru at every capacity" in text


def test_cli_names_capacities_where_the_default_is_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2 slots; 1 is read twice, then chain 2-3, then 2 again. Admitting 3, parc and ARC evict
    # 2 (parc: an old chain eats its own tail; ARC: T1's oldest), LRU evicts 1 and hits 2.
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(mooncake([1], [1], [2, 3], [2])) + "\n")
    assert main(["simulate", str(trace), "--capacities", "2", "--policies", "parc,arc,lru"]) == 0
    text = capsys.readouterr().out
    # Behind LRU only, level with ARC: the line names the better of the two.
    assert "parc saves fewer tokens than the better of arc and lru at 2 blocks" in text


def test_cli_bad_trace_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"hash_ids": [1]}\n')
    assert main(["simulate", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1: missing fields" in err


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared Mooncake trace not present")
def test_shared_trace_arc_at_least_lru() -> None:
    # 2%, 10% and 30% of the trace's 40,148 unique (full) blocks (the default sweep's range).
    trace = load_trace(SHARED_TRACE)
    capacities = [803, 4015, 12044]
    result = simulate(trace, capacities)
    for capacity in capacities:
        arc, lru, opt = (result.result(p, capacity) for p in ("arc", "lru", "belady"))
        assert lru.hits <= arc.hits <= opt.hits
        assert lru.tokens_saved <= arc.tokens_saved <= opt.tokens_saved
        bound = result.tokens_saved_bound(capacity)
        assert bound is not None
        for policy in result.policies:
            assert result.result(policy, capacity).tokens_saved_ratio <= bound


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--capacities", "1" + "0" * 400], "--capacities"),
        (["--capacities", str((1 << 53) + 1)], "--capacities"),
        (["--limit", "0"], "--limit"),
        (["--limit", "-3"], "--limit"),
        (["--block-tokens", "0"], "--block-tokens"),
    ],
)
def test_out_of_range_options_are_one_line_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], option: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(mooncake([1, 2], [1, 3])))
    assert exit_code(["simulate", str(trace), *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and option in err.splitlines()[-1]
    assert len(err.splitlines()[-1]) < 200  # a huge value is not echoed in full
