"""Sizes (``500G``) and ages (``7d``) as users write them: CLI flags, store options, vLLM options.

Sizes are a number with an optional suffix.
``K M G T P`` and ``KiB MiB GiB TiB PiB`` are powers of 1024, as ``du -h`` and ``df -h`` print.
``KB MB GB TB PB`` are powers of 1000, as disk vendors print.
No suffix or ``B`` means bytes. Case does not matter.
Ages are one or more ``<number><unit>`` parts with units ``s m h d w``.
Examples are ``90m``, ``1d12h`` and ``1.5h``. A bare number is seconds.

Both are bounded, by :data:`MAX_BYTES` and :data:`MAX_SECONDS`.
A value past the bound, infinity or NaN is a :class:`ConfigError`.
It is never an ``OverflowError`` from a later ``int()`` or a wait.
"""

from __future__ import annotations

import math
import re
import reprlib
from decimal import Decimal, InvalidOperation

from chunkstore.errors import ConfigError

MAX_BYTES = 1 << 60
"""Largest size accepted, 1 EiB. No memory pool, disk or bucket quota holds that much."""
MAX_SECONDS = 100 * 365 * 86400
"""Longest duration accepted, 100 years.
It is below ``threading.TIMEOUT_MAX``, so any parsed duration can be a wait's timeout."""

_BINARY = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?(?:ib|b)?)\s*", re.IGNORECASE | re.ASCII)
_AGE_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhdw])", re.IGNORECASE | re.ASCII)
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE_LABELS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def shown(value: object) -> str:
    """``repr(value)`` cut to a few dozen characters, for an error line about user input."""
    return reprlib.repr(value)


def parse_size(text: str | int | float) -> int:
    """Bytes meant by ``text``, as ``"500G"`` -> 536870912000. Raises :class:`ConfigError`.

    Non-negative ints and floats are byte counts as they are, up to :data:`MAX_BYTES`.
    """
    if isinstance(text, bool):
        raise ConfigError(f"invalid size {text!r}")
    if isinstance(text, (int, float)):
        if isinstance(text, float) and not math.isfinite(text):
            raise ConfigError(f"invalid size {text!r}: must be a finite byte count")
        return _bounded_size(text, text)
    if not isinstance(text, str):
        raise ConfigError(
            f"invalid size {shown(text)}: use a number with an optional unit, e.g. 500G"
        )
    match = _SIZE.fullmatch(text or "")
    if match is None:
        raise ConfigError(
            f"invalid size {shown(text)}: use a number with an optional unit, "
            "e.g. 500G, 1.5T, 800MB"
        )
    number, unit = Decimal(match.group(1)), match.group(2).lower()
    if unit in _DECIMAL:
        factor = _DECIMAL[unit]
    elif unit in _BINARY:
        factor = _BINARY[unit]
    elif unit[0] in _BINARY and unit[1:] == "ib":
        factor = _BINARY[unit[0]]
    else:
        raise ConfigError(f"invalid size {shown(text)}: unknown unit {match.group(2)!r}")
    return _bounded_size(number * factor, text)


def _bounded_size(value: int | float | Decimal, text: object) -> int:
    # Compared before int(): the value may be a Decimal with hundreds of digits.
    if value < 0:
        raise ConfigError(f"invalid size {shown(text)}: must be a non-negative byte count")
    if value > MAX_BYTES:
        raise ConfigError(f"invalid size {shown(text)}: larger than the maximum of 1 EiB")
    return int(value)


def parse_age(text: str | int | float) -> float:
    """Seconds meant by ``text``, as ``"7d"`` -> 604800.0. Raises :class:`ConfigError`.

    Non-negative ints and floats are seconds as they are, up to :data:`MAX_SECONDS`.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ConfigError(f"invalid age {shown(text)}: use e.g. 30s, 90m, 12h, 7d or seconds")
    if isinstance(text, (int, float)):
        finite = isinstance(text, int) or math.isfinite(text)
        return _bounded_seconds(Decimal(text) if finite else text, text)
    raw = text.strip()
    try:
        number = Decimal(raw)
    except InvalidOperation:
        pass
    else:
        return _bounded_seconds(number, text)
    compact = raw.replace(" ", "")
    parts = _AGE_PART.findall(compact)
    if not parts or "".join(n + u for n, u in parts).lower() != compact.lower():
        raise ConfigError(f"invalid age {shown(text)}: use e.g. 30s, 90m, 12h, 7d, 2w or 1d12h")
    return _bounded_seconds(sum(Decimal(n) * _AGE_UNITS[u.lower()] for n, u in parts), text)


def _bounded_seconds(value: Decimal | float, text: object) -> float:
    if isinstance(value, float) or not value.is_finite() or value < 0:
        raise ConfigError(f"invalid age {shown(text)}: must be a non-negative duration")
    if value > MAX_SECONDS:
        raise ConfigError(f"invalid age {shown(text)}: longer than the maximum of 100 years")
    return float(value)


def format_size(size: float) -> str:
    """Human size with binary units: ``12.0 KiB``, ``3.4 GiB``; plain bytes below 1 KiB."""
    if size < 1024:
        return f"{int(size)} B"
    value = float(size)
    for label in _SIZE_LABELS:
        if value < 1024 or label == _SIZE_LABELS[-1]:
            return f"{value:.1f} {label}"
        value /= 1024
    raise AssertionError("unreachable")


def format_age(seconds: float) -> str:
    """Coarse human duration: ``45s``, ``12m``, ``5h 3m``, ``3d 4h``, ``10w 2d``, ``4w``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{int(seconds)}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m"
    if seconds < 86400:
        big, small = divmod(int(seconds), 3600)
        return _two_units(big, "h", small // 60, "m")
    if seconds < 7 * 86400:
        big, small = divmod(int(seconds), 86400)
        return _two_units(big, "d", small // 3600, "h")
    big, small = divmod(int(seconds), 7 * 86400)
    return _two_units(big, "w", small // 86400, "d")


def _two_units(big: int, big_unit: str, small: int, small_unit: str) -> str:
    return f"{big}{big_unit} {small}{small_unit}" if small else f"{big}{big_unit}"
