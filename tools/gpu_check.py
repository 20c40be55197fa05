#!/usr/bin/env python3
"""GPU check of the vLLM connector's device copies: throughput vs a raw pinned ``copy_``.

    python tools/gpu_check.py [--chunks 8] [--iters 5] [--layers 32] [--json]

Needs a CUDA GPU and torch (vLLM itself is not needed). The KV cache is a
FlashAttention-layout paged cache shaped like Llama-3-8B (32 layers, 8 KV
heads, head_dim 128, bf16, block 16) and chunks hold 256 tokens (32 MiB each).
For both directions it times, on the device:

* connector: ``ChunkStoreWorker.copy_out`` (gather on the side stream, then
  device -> host into pinned host-cache slots) and ``copy_in`` (host -> device
  from those slots, then scatter into the paged cache), i.e. the copy path of
  saves and loads without sealing, checksums or tier writes;
* raw: one ``pinned.copy_(device, non_blocking=True)`` (and back) of the same
  number of bytes, the best a single copy can do.

It prints the ratio connector / raw per direction (goal: >= 0.8), the same for
unpinned host buffers (through a pinned staging buffer), how long the CPU is
busy issuing a save (the forward pass is not held up longer than that), and
checks that a saved then loaded batch is bit-identical. Exits 0 with a message
when CUDA is absent; never fails on a threshold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8, help="chunks per batch (default 8)")
    parser.add_argument("--iters", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to measure")
        return 0
    result = run(args, torch)
    if args.json:
        print(json.dumps(result))
    return 0


def _build(args, torch, device):
    from chunkstore.format import ATTENTION, ChunkLayout, KVSpec, LayerGroup
    from chunkstore.tiering import ProcessCache
    from chunkstore.vllm.config import parse_config
    from chunkstore.vllm.engine import EngineKV, LayerInfo
    from chunkstore.vllm.worker import ChunkStoreWorker

    block, chunk = 16, 256
    heads, dim = args.kv_heads, args.head_dim
    spec = KVSpec(
        "gpu-check/llama-like",
        "BF16",
        chunk,
        (LayerGroup(ATTENTION, tuple(range(args.layers)), heads, dim),),
    )
    layout = ChunkLayout(spec)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    layers = {n: LayerInfo(n, i, 0, ATTENTION, 0, heads, dim, True) for i, n in enumerate(names)}
    engine = EngineKV(spec, layout, layers, block, 0, 1, 1, None)
    cfg = parse_config({"chunk_tokens": chunk}, block_size=block)
    # The host cache pins its pool with cudaHostRegister when torch sees CUDA.
    store = ProcessCache(host_bytes=(2 * args.chunks + 1) * layout.total_size, layout=layout)
    worker = ChunkStoreWorker(engine, cfg, store)
    blocks_per_chunk = chunk // block
    num_blocks = 2 * args.chunks * blocks_per_chunk + 1
    kv = {}
    for n in names:
        # FlashAttention: [num_blocks, block, heads, 2*dim] in memory, [B, H, N, 2D] logically.
        t = torch.randn(num_blocks, block, heads, 2 * dim, device=device).to(torch.bfloat16)
        kv[n] = t.transpose(1, 2)
    worker.register_kv_caches(kv, backends=dict.fromkeys(names, "FLASH_ATTN"))
    return store, worker, kv, layout, blocks_per_chunk


def _plans(args, layout, blocks_per_chunk):
    from chunkstore.hashing import ChunkKey
    from chunkstore.vllm.metadata import ChunkLoad, ChunkSave

    saves, loads = [], []
    for j in range(args.chunks):
        key = ChunkKey(bytes([j + 1]) * 32, "00" * 8)
        src = tuple(range(1 + j * blocks_per_chunk, 1 + (j + 1) * blocks_per_chunk))
        dst = tuple(b + args.chunks * blocks_per_chunk for b in src)
        saves.append(ChunkSave("gpu-check", key, b"\0" * 32, (0,) * 256, (src,)))
        loads.append(ChunkLoad("gpu-check", key, (dst,), 0, False))
    return saves, loads


def _time(torch, fn, iters):
    fn()  # warm-up (allocator, first copies)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args, torch) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    store, worker, kv, layout, bpc = _build(args, torch, device)
    saves, loads = _plans(args, layout, bpc)
    leases = [store.reserve(s.key) for s in saves]
    pinned_slots = all(lease is not None for lease in leases)
    payloads = [lease.view[layout.data_offset :] for lease in leases]
    nbytes = args.chunks * layout.payload_size

    def save():
        worker.copy_out(saves, payloads).fence.wait()

    def load():
        worker.copy_in(loads, payloads, block_compute=True).fence.wait()

    unpinned = [bytearray(layout.payload_size) for _ in saves]

    def save_unpinned():
        worker.copy_out(saves, unpinned).fence.wait()

    def load_unpinned():
        worker.copy_in(loads, unpinned, block_compute=True).fence.wait()

    raw_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def raw_d2h():
        raw_host.copy_(raw_dev, non_blocking=True)

    def raw_h2d():
        raw_dev.copy_(raw_host, non_blocking=True)

    t = {
        "raw_d2h": _time(torch, raw_d2h, args.iters),
        "raw_h2d": _time(torch, raw_h2d, args.iters),
        "save": _time(torch, save, args.iters),
        "load": _time(torch, load, args.iters),
        "save_unpinned": _time(torch, save_unpinned, args.iters),
        "load_unpinned": _time(torch, load_unpinned, args.iters),
    }
    # CPU time to issue a save (what the forward pass of the next step waits behind).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    batch = worker.copy_out(saves, payloads)
    issue_s = time.perf_counter() - t0
    batch.fence.wait()

    # Round trip: the loaded blocks equal the saved ones, bit for bit.
    save()
    load()
    torch.cuda.synchronize()
    same = all(
        torch.equal(kv[n][list(s.block_ids[0])], kv[n][list(ld.block_ids[0])])
        for n in kv
        for s, ld in zip(saves, loads)
    )
    for lease in leases:
        store.abort(lease)
    store.close()

    gbps = {k: nbytes / v / 1e9 for k, v in t.items()}
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "chunks": args.chunks,
        "bytes_per_batch": nbytes,
        "host_slots_pinned": pinned_slots,
        "GBps": {k: round(v, 2) for k, v in gbps.items()},
        "ratio_d2h": round(gbps["save"] / gbps["raw_d2h"], 3),
        "ratio_h2d": round(gbps["load"] / gbps["raw_h2d"], 3),
        "ratio_d2h_unpinned": round(gbps["save_unpinned"] / gbps["raw_d2h"], 3),
        "ratio_h2d_unpinned": round(gbps["load_unpinned"] / gbps["raw_h2d"], 3),
        "save_issue_ms": round(issue_s * 1000, 3),
        "round_trip_identical": same,
    }
    print(
        f"gpu_check on {result['gpu']}: {args.chunks} chunks of "
        f"{layout.payload_size / 2**20:.0f} MiB per batch, host slots pinned: {pinned_slots}"
    )
    print(f"  raw pinned copy_:  D2H {gbps['raw_d2h']:6.1f} GB/s   H2D {gbps['raw_h2d']:6.1f} GB/s")
    print(
        f"  connector:         D2H {gbps['save']:6.1f} GB/s   H2D {gbps['load']:6.1f} GB/s"
        f"   ratio {result['ratio_d2h']:.2f} / {result['ratio_h2d']:.2f}  (goal >= 0.8)"
    )
    print(
        f"  unpinned + staging D2H {gbps['save_unpinned']:6.1f} GB/s   H2D "
        f"{gbps['load_unpinned']:6.1f} GB/s   ratio {result['ratio_d2h_unpinned']:.2f} / "
        f"{result['ratio_h2d_unpinned']:.2f}"
    )
    print(
        f"  CPU time to issue a save batch: {result['save_issue_ms']:.2f} ms; "
        f"round trip bit-identical: {same}"
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
