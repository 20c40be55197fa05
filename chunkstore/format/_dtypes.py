"""Element types a chunk can hold, by their safetensors names."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunkstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DType:
    """One element type as it appears in a chunk header."""

    name: str
    """The safetensors dtype string written in the header (``"BF16"``)."""
    itemsize: int
    """Bytes per element."""
    numpy: np.dtype
    """The numpy dtype used for views (ml_dtypes supplies bf16 and fp8)."""


_NUMPY_NAMES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "U8": "uint8",
}
"""Each safetensors name's numpy type name, in numpy or else in ml_dtypes."""
_FROM_ML_DTYPES = frozenset({"BF16", "F8_E4M3", "F8_E5M2"})
# Note: importing ml_dtypes is slow, so it loads on the first lookup of a type it
# supplies: `chunkstore --help` and `ls` never need it (tools/bench_cli_startup.py).
_TABLE: dict[str, DType] = {}
"""The types looked up so far, by safetensors name."""


def _entry(name: str) -> DType:
    """The :class:`DType` of safetensors name ``name``, built on first use."""
    if name in _FROM_ML_DTYPES:
        import ml_dtypes

        numpy = np.dtype(getattr(ml_dtypes, _NUMPY_NAMES[name]))
    else:
        numpy = np.dtype(_NUMPY_NAMES[name])
    # Two threads may build the same entry; both are equal, so either may stay.
    return _TABLE.setdefault(name, DType(name, numpy.itemsize, numpy))


_ALIASES = {
    "bf16": "BF16",
    "bfloat16": "BF16",
    "torch.bfloat16": "BF16",
    "fp16": "F16",
    "f16": "F16",
    "float16": "F16",
    "half": "F16",
    "torch.float16": "F16",
    "fp32": "F32",
    "f32": "F32",
    "float32": "F32",
    "float": "F32",
    "torch.float32": "F32",
    "fp8": "F8_E4M3",
    "fp8_e4m3": "F8_E4M3",
    "f8_e4m3": "F8_E4M3",
    "float8_e4m3fn": "F8_E4M3",
    "torch.float8_e4m3fn": "F8_E4M3",
    "fp8_e5m2": "F8_E5M2",
    "f8_e5m2": "F8_E5M2",
    "float8_e5m2": "F8_E5M2",
    "torch.float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "i8": "I8",
    "uint8": "U8",
    "u8": "U8",
}


def dtype_named(name: str) -> DType:
    """Look a dtype up by safetensors name or common alias (``bf16``, ``torch.float16``)."""
    key = name if name in _NUMPY_NAMES else _ALIASES.get(str(name).lower())
    if key is None:
        raise ConfigError(f"unknown dtype {name!r}; known: {', '.join(sorted(_NUMPY_NAMES))}")
    return _TABLE.get(key) or _entry(key)


def is_known_dtype(name: str) -> bool:
    """Whether ``name`` is a safetensors dtype string this version can read."""
    return name in _NUMPY_NAMES
