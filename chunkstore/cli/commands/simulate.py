"""``chunkstore simulate``: size a host cache by replaying a request trace."""

from __future__ import annotations

import argparse
from pathlib import Path

from chunkstore.cache.policy import DEFAULT_POLICY, POLICY_NAMES
from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.table import render_table
from chunkstore.errors import ConfigError
from chunkstore.simulator import SIMULATED_POLICIES, Simulation, load_trace, simulate
from chunkstore.units import format_size, parse_size, shown

EXAMPLES = """examples:
  chunkstore simulate trace.jsonl
  chunkstore simulate trace.jsonl --capacities 1000,5000,20000 --plot hit-ratio.png
  chunkstore simulate trace.jsonl --block-bytes 40MiB --json
  chunkstore gen-trace chat --requests 3000 --seed 1 -o chat.jsonl && chunkstore simulate chat.jsonl
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a request trace through every host-cache policy and Belady's MIN",
        description=(
            "Replays a JSONL request trace through the host cache's real replacement "
            f"policies ({', '.join(POLICY_NAMES)}) and Belady's offline MIN, at several "
            "capacities, and reports per policy the block hit ratio, the prompt tokens that "
            "would not be recomputed (the leading run of hits of each request: a chunk is "
            "useless without every chunk before it) and the gap to Belady on both. Belady is "
            "MIN on the block stream (optimal for block hits; prefix-aware because a parent's "
            "next use always precedes its child's), its tokens saved counted the same way; it "
            "does not bound tokens saved, so that gap can be negative. Traces: Mooncake format "
            "(timestamp, input_length, output_length, hash_ids) or one 'tokens' list per "
            "line; 'chunkstore gen-trace' writes synthetic ones. Only full blocks are looked "
            "up and cached, as the engine does: a prompt's partial last block (a Mooncake hash "
            "id past input_length // block tokens) is always recomputed."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", help="JSONL trace file")
    parser.add_argument(
        "--capacities",
        metavar="N,N,...",
        type=_capacities,
        default=None,
        help="cache sizes in blocks (default: 1%%..75%% of the trace's unique blocks)",
    )
    parser.add_argument(
        "--policies",
        metavar="P,P,...",
        type=_policies,
        default=SIMULATED_POLICIES,
        help=f"policies to compare (default: {','.join(SIMULATED_POLICIES)})",
    )
    parser.add_argument(
        "--block-tokens",
        metavar="N",
        type=int,
        default=512,
        help=(
            "tokens per block (Mooncake traces: 512, each hash id a block of N; token traces "
            "are cut into blocks of N; a partial last block is never cached)"
        ),
    )
    parser.add_argument(
        "--block-bytes",
        metavar="SIZE",
        type=parse_size,
        default=None,
        help="bytes per block (e.g. 40MiB): also show capacities as host memory",
    )
    parser.add_argument(
        "--limit", metavar="N", type=int, default=None, help="replay only the first N requests"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        type=Path,
        default=None,
        help="draw hit ratio and tokens saved against capacity into FILE (PNG/SVG/PDF)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=run)


MAX_CAPACITY = 1 << 53
"""Largest ``--capacities`` entry: beyond it a share of the trace is no float any more."""


def _capacities(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capacities must be integers (blocks), got {text!r}"
        ) from None
    if not values or any(not 1 <= v <= MAX_CAPACITY for v in values):
        raise argparse.ArgumentTypeError(
            f"capacities must be block counts in 1..2^53, got {shown(text)}"
        )
    return values


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    unknown = [n for n in names if n not in SIMULATED_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or text!r}; "
            f"choose from {','.join(SIMULATED_POLICIES)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    if args.block_tokens < 1:
        raise ConfigError(f"--block-tokens must be positive, got {shown(args.block_tokens)}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1 request, got {shown(args.limit)}")
    trace = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
    result = simulate(trace, args.capacities, args.policies)
    if args.plot is not None:
        from chunkstore.simulator.plot import plot_simulation

        plot_simulation(result, args.plot, block_bytes=args.block_bytes)
    if args.json:
        emit_json(to_document(result, args.block_bytes, args.plot))
    else:
        emit_text(render(result, args.block_bytes, args.plot))
    return 0


def to_document(
    result: Simulation, block_bytes: int | None, plot: Path | None
) -> dict[str, object]:
    """The ``--json`` document: one entry per (capacity, policy), gaps to Belady included."""
    trace = result.trace
    entries = []
    for entry in result.results:
        fields = entry.to_dict()
        gap = result.gap_to_belady(entry.policy, entry.capacity)
        if gap is not None:
            fields["hit_ratio_gap_to_belady"], fields["tokens_saved_gap_to_belady"] = gap
            fields["tokens_saved_bound"] = result.tokens_saved_bound(entry.capacity)
        entries.append(fields)
    return {
        "trace": trace.source,
        "requests": len(trace.requests),
        "accesses": trace.accesses,
        "unique_blocks": trace.unique_blocks,
        "block_tokens": trace.block_tokens,
        "block_bytes": block_bytes,
        "input_tokens": trace.input_tokens,
        "capacities": list(result.capacities),
        "policies": list(result.policies),
        "results": entries,
        "plot": str(plot) if plot else None,
    }


def render(result: Simulation, block_bytes: int | None, plot: Path | None) -> str:
    """The human report: one row per capacity and policy, gaps to Belady in points."""
    trace = result.trace
    with_belady = "belady" in result.policies
    headers = ["capacity", "% unique"] + (["memory"] if block_bytes else [])
    headers += ["policy", "hit%", "saved%"]
    if with_belady:
        headers += ["hit gap", "saved gap"]
    with_arc = "arc" in result.policies
    if with_arc:
        headers.append("saved/arc")
    rows = []
    for capacity in result.capacities:
        for policy in result.policies:
            entry = result.result(policy, capacity)
            row: list[object] = [capacity, f"{capacity / trace.unique_blocks * 100:.1f}"]
            if block_bytes:
                row.append(format_size(capacity * block_bytes))
            row += [policy, f"{entry.hit_ratio * 100:.2f}", f"{entry.tokens_saved_ratio * 100:.2f}"]
            gap = result.gap_to_belady(policy, capacity)
            if gap is not None:
                row += [f"{gap[0] * 100:+.2f}", f"{gap[1] * 100:+.2f}"]
            if with_arc:
                arc = result.result("arc", capacity).tokens_saved
                row.append(f"{entry.tokens_saved / arc:.3f}" if arc else "-")
            rows.append(row)
    right = [i for i, h in enumerate(headers) if h != "policy"]
    lines = [
        f"trace {trace.source}: {len(trace.requests)} requests, {trace.accesses} block lookups, "
        f"{trace.unique_blocks} unique blocks of {trace.block_tokens} tokens, "
        f"{trace.input_tokens} prompt tokens",
        "",
        render_table(headers, rows, right=right),
        "",
        "hit% = block hit ratio (full blocks; a partial last block is always recomputed); "
        "saved% = prompt tokens not recomputed (leading hits per request)",
    ]
    if with_belady:
        lines.append(
            "gap = Belady (MIN on blocks) minus the policy, in points; MIN maximises block hits, "
            "not tokens saved, so a saved gap can be negative"
        )
        bounds = ", ".join(
            f"{c}: {(result.tokens_saved_bound(c) or 0.0) * 100:.2f}" for c in result.capacities
        )
        lines.append(f"no policy can save more than (saved%, Belady hits x block size): {bounds}")
    lines += _comparisons(result)
    if plot is not None:
        lines.append(f"plot written to {plot}")
    return "\n".join(lines)


def _comparisons(result: Simulation) -> list[str]:
    """One line: where the default policy saves fewer tokens than ARC or LRU, if anywhere."""
    rivals = [p for p in ("arc", "lru") if p in result.policies and p != DEFAULT_POLICY]
    if DEFAULT_POLICY not in result.policies or not rivals:
        return []
    behind = [
        c
        for c in result.capacities
        if result.result(DEFAULT_POLICY, c).tokens_saved
        < max(result.result(p, c).tokens_saved for p in rivals)
    ]
    against = " and ".join(rivals)
    if not behind:
        return [f"{DEFAULT_POLICY} saves at least as many tokens as {against} at every capacity"]
    where = ", ".join(map(str, behind))
    # Behind the better of the two, which need not be behind both.
    better = f"the better of {against}" if len(rivals) > 1 else against
    return [f"{DEFAULT_POLICY} saves fewer tokens than {better} at {where} blocks"]
