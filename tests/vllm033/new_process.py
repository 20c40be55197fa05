"""Run in a fresh process by test_a_new_process_finds_what_an_earlier_one_stored: build the
tier on an existing directory, look the prompt's chunks up and load them; print a JSON report.

Usage: python -m tests.vllm033.new_process MODEL_DIR KV_DIR PROMPT_JSON
"""

from __future__ import annotations

import json
import os
import sys

from chunkstore.vllm.testing import engine_env

os.environ.update(engine_env())


def main(model_dir: str, kv_dir: str, prompt: list[int]) -> dict[str, object]:
    import torch

    from tests.vllm.harness import make_harness

    from .tier_harness import (
        CHUNK_TOKENS,
        announce,
        finish,
        job,
        lookup,
        make_request,
        make_tier,
        nhd_slot,
        offload_keys,
        primary,
    )

    h = make_harness(model_dir)
    mem = primary(8)
    tier = make_tier(h, mem, [kv_dir])
    try:
        request = make_request(prompt, "later")
        ctx = announce(tier, request)
        keys = offload_keys(request, ctx, 4)
        found = lookup(tier, keys, ctx)
        tier.submit_load(job(keys, [0, 1, 2, 3], ctx, promotion=True))
        (result,) = finish(tier)
        match = all(torch.equal(mem[i], nhd_slot(prompt, i * CHUNK_TOKENS)) for i in range(4))
        return {"lookups": [r.name for r in found], "loaded": result.success, "slots_match": match}
    finally:
        tier.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
