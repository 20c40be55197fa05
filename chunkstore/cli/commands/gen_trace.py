"""``chunkstore gen-trace``: write a seeded synthetic request trace for ``chunkstore simulate``."""

from __future__ import annotations

import argparse
from pathlib import Path

from chunkstore.cli.output import emit_json, emit_text
from chunkstore.errors import ConfigError
from chunkstore.simulator.generate import WORKLOADS, generate_trace, write_trace
from chunkstore.units import shown

EXAMPLES = """examples:
  chunkstore gen-trace chat -o chat.jsonl
  chunkstore gen-trace rag --requests 10000 --seed 7 -o rag.jsonl
  chunkstore simulate rag.jsonl --plot rag.png
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gen-trace",
        help="write a seeded synthetic request trace (Mooncake JSONL) for 'simulate'",
        description=(
            "Generates a request trace for one workload and writes it in the Mooncake "
            "format (timestamp, input_length, output_length, hash_ids of prefix-chained "
            "blocks) that 'chunkstore simulate' reads. Workloads: chat (multi-turn "
            "conversations with think times), system-prompts (many short conversations "
            "under a few shared system prompts), rag (documents drawn from a pool with "
            "Zipf popularity), agent (shared tool definitions and a transcript that grows "
            "at every step). The same workload, seed and options give the same file."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("workload", choices=sorted(WORKLOADS), help="which workload to generate")
    parser.add_argument(
        "-o", "--output", metavar="FILE", type=Path, required=True, help="trace file to write"
    )
    parser.add_argument(
        "--requests", metavar="N", type=int, default=3000, help="requests (default: 3000)"
    )
    parser.add_argument("--seed", metavar="N", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--block-tokens",
        metavar="N",
        type=int,
        default=512,
        help="tokens per block, as 'simulate --block-tokens' (default: 512)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=run)


MAX_REQUESTS = 10_000_000
"""Most requests ``--requests`` accepts (a few GiB of JSON lines; more never ends usefully)."""


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise ConfigError(f"--requests must be 1..{MAX_REQUESTS:,}, got {shown(args.requests)}")
    if args.block_tokens < 1:
        raise ConfigError(f"--block-tokens must be positive, got {shown(args.block_tokens)}")
    requests = generate_trace(
        args.workload, requests=args.requests, seed=args.seed, block_tokens=args.block_tokens
    )
    path = write_trace(requests, args.output)
    summary = {
        "workload": args.workload,
        "seed": args.seed,
        "requests": len(requests),
        "unique_blocks": len({b for r in requests for b in r.hash_ids}),
        "prompt_tokens": sum(r.input_length for r in requests),
        "path": str(path),
    }
    if args.json:
        emit_json(summary)
    else:
        emit_text(
            f"wrote {summary['requests']} {args.workload} requests "
            f"({summary['unique_blocks']} unique blocks, {summary['prompt_tokens']} prompt "
            f"tokens) to {path}"
        )
    return 0
