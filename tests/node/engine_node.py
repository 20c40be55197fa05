"""A tiny vLLM engine on CPU attached to a node service; the node engine test runs it.

``python -m tests.node.engine_node MODEL_DIR SOCKET PROMPTS_JSON OUT_JSON [PAUSE_DIR]``

Generates greedy tokens for each prompt (``tests.vllm.engine_run.generate``) and
writes them with the connector's counters to ``OUT_JSON``. With ``PAUSE_DIR``
it then writes ``PAUSE_DIR/paused``, waits for ``PAUSE_DIR/go`` (the test kills
the service meanwhile), resets its prefix cache and runs the prompts again:
``{"first": [...], "after": [...]}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from chunkstore.vllm.testing import engine_env

os.environ.update(engine_env())


def main(argv: list[str]) -> int:
    from tests.vllm.engine_run import generate, make_llm

    model_dir, socket, prompts_path, out_path = argv[:4]
    prompts = json.loads(Path(prompts_path).read_text())
    # No tiers of the engine's own: the node service owns host memory and the tiers.
    llm = make_llm(model_dir, "-", tiers=[], node=f"unix://{socket}")
    results: dict[str, object] = {"first": generate(llm, prompts)}
    if len(argv) > 4:
        pause = Path(argv[4])
        (pause / "paused").write_text("")
        while not (pause / "go").exists():
            time.sleep(0.05)
        assert llm.reset_prefix_cache()
        results["after"] = generate(llm, prompts)
    Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
