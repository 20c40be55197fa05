"""Element types a chunk can hold, by their safetensors names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class DType:
    """One element type as it appears in a chunk header."""

    name: str
    """The safetensors dtype string written in the header (``"BF16"``)."""
    itemsize: int
    """Bytes per element."""

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype used for views; ml_dtypes supplies bf16 and fp8."""
        found = _NUMPY.get(self.name)
        return found if found is not None else _numpy_dtype(self.name)


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
_ITEMSIZES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}
"""Bytes per element of each safetensors name."""
_FROM_ML_DTYPES = frozenset({"BF16", "F8_E4M3", "F8_E5M2"})
# numpy and ml_dtypes load on the first view of a tensor, not on import: the CLI's
# `--help` and `ls` never need them (tools/bench_cli_startup.py).
_TABLE = {name: DType(name, size) for name, size in _ITEMSIZES.items()}
"""Each safetensors name's :class:`DType`."""
_NUMPY: dict[str, np.dtype] = {}
"""The numpy dtypes looked up so far, by safetensors name."""


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of safetensors name ``name``, built on first use."""
    import numpy as np

    if name in _FROM_ML_DTYPES:
        import ml_dtypes

        found = np.dtype(getattr(ml_dtypes, _NUMPY_NAMES[name]))
    else:
        found = np.dtype(_NUMPY_NAMES[name])
    # Two threads may build the same entry; both are equal, so either may stay.
    return _NUMPY.setdefault(name, found)


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
    return _TABLE[key]


def is_known_dtype(name: str) -> bool:
    """Whether ``name`` is a safetensors dtype string this version can read."""
    return name in _NUMPY_NAMES
