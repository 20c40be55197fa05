"""``chunkstore simulate``: size a host cache by replaying a request trace."""

from __future__ import annotations

import argparse
from pathlib import Path

from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.table import render_table
from chunkstore.errors import ConfigError
from chunkstore.simulator import SIMULATED_POLICIES, Simulation, load_trace, simulate
from chunkstore.units import format_size, parse_size

EXAMPLES = """examples:
  chunkstore simulate trace.jsonl
  chunkstore simulate trace.jsonl --capacities 1000,5000,20000 --plot hit-ratio.png
  chunkstore simulate trace.jsonl --block-bytes 40MiB --json
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a request trace through ARC, LRU and Belady's optimum at several cache sizes",
        description=(
            "Replays a JSONL request trace through the host cache's real replacement "
            "policies (ARC, LRU) and Belady's offline optimum, at several capacities, and "
            "reports the block hit ratio and the prompt tokens that would not be recomputed "
            "(the leading run of hits of each request). Traces: Mooncake format (timestamp, "
            "input_length, output_length, hash_ids) or one 'tokens' list per line."
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
        help="cache sizes in blocks (default: 2%%..75%% of the trace's unique blocks)",
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
        help="tokens per block (Mooncake traces: 512; token traces are cut into blocks of N)",
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
        help="draw hit ratio against capacity into FILE (PNG/SVG/PDF; matplotlib)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=run)


def _capacities(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capacities must be integers (blocks), got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"capacities must be positive block counts, got {text!r}")
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
        raise ConfigError(f"--block-tokens must be positive, got {args.block_tokens}")
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
    """The ``--json`` document."""
    trace = result.trace
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
        "results": [r.to_dict() for r in result.results],
        "plot": str(plot) if plot else None,
    }


def render(result: Simulation, block_bytes: int | None, plot: Path | None) -> str:
    """The human report: one row per capacity, hit ratio and tokens saved per policy."""
    trace = result.trace
    headers = ["capacity"] + (["memory"] if block_bytes else [])
    headers += [f"{p} hit%" for p in result.policies]
    headers += [f"{p} saved%" for p in result.policies]
    rows = []
    for capacity in result.capacities:
        row: list[object] = [capacity]
        if block_bytes:
            row.append(format_size(capacity * block_bytes))
        entries = [result.result(p, capacity) for p in result.policies]
        row += [f"{e.hit_ratio * 100:.2f}" for e in entries]
        row += [f"{e.tokens_saved_ratio * 100:.2f}" for e in entries]
        rows.append(row)
    right = list(range(len(headers)))
    lines = [
        f"trace {trace.source}: {len(trace.requests)} requests, {trace.accesses} block lookups, "
        f"{trace.unique_blocks} unique blocks of {trace.block_tokens} tokens, "
        f"{trace.input_tokens} prompt tokens",
        "",
        render_table(headers, rows, right=right),
        "",
        "hit% = block hit ratio; saved% = prompt tokens not recomputed (leading hits per request)",
    ]
    if "arc" in result.policies and "lru" in result.policies:
        worse = [
            c
            for c in result.capacities
            if result.result("arc", c).hits < result.result("lru", c).hits
        ]
        lines.append(
            "ARC >= LRU at every capacity"
            if not worse
            else f"LRU beats ARC at {', '.join(map(str, worse))} blocks"
        )
    if plot is not None:
        lines.append(f"plot written to {plot}")
    return "\n".join(lines)
