"""``open_store(url)``: URL schemes to store classes, with lazy imports of optional backends."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkstore.backends.base import Store
from chunkstore.errors import ConfigError, MissingDependency

# scheme -> (module, factory attribute, install hint). Modules import lazily so that a
# missing optional dependency only matters to users of that scheme (fsspec registry style).
_SCHEMES: dict[str, tuple[str, str, str]] = {
    "memory": ("chunkstore.backends.memory", "MemoryStore", ""),
}
_FALLBACK: tuple[str, str, str] | None = None


def register_scheme(scheme: str, module: str, attribute: str, hint: str = "") -> None:
    """Map URL ``scheme`` to ``module.attribute`` (a callable ``(url, **options) -> Store``)."""
    _SCHEMES[scheme] = (module, attribute, hint)


def set_fallback(module: str, attribute: str, hint: str = "") -> None:
    """The factory for bare paths, ``file://`` and every scheme not registered (fsspec)."""
    global _FALLBACK
    _FALLBACK = (module, attribute, hint)


def load_options(config: str | Path | None) -> dict[str, Any]:
    """Read store options from a JSON or YAML file (``.yaml``/``.yml`` need PyYAML)."""
    if config is None:
        return {}
    path = Path(config)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read store config {path}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise MissingDependency(
                "YAML configs need PyYAML: pip install 'chunkstore[yaml]'"
            ) from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"store config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"store config {path} must hold a mapping of options")
    return data


def _resolve(entry: tuple[str, str, str]) -> Callable[..., Store]:
    module_name, attribute, hint = entry
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if isinstance(exc, MissingDependency):
            raise
        message = f"this store needs a missing dependency ({exc.name})"
        raise MissingDependency(f"{message}: {hint}" if hint else message) from None
    factory: Callable[..., Store] = getattr(module, attribute)
    return factory


def open_store(url: str, *, config: str | Path | None = None, **options: Any) -> Store:
    """Open the store at ``url``.

    ``memory://``, ``file:///path`` or a bare path, ``s3://bucket/prefix``, and
    any other fsspec URL. Options come from keyword arguments, or a JSON/YAML
    file named by ``config`` (keyword arguments win).
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("a store URL must be a non-empty string")
    merged = {**load_options(config), **options}
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in _SCHEMES:
        factory = _resolve(_SCHEMES[scheme])
        if scheme == "memory":
            return factory(**merged)
        return factory(url, **merged)
    if _FALLBACK is None:
        raise ConfigError(f"no store handles {url!r}")
    return _resolve(_FALLBACK)(url, **merged)


set_fallback("chunkstore.backends.fs", "open_fs_store")
register_scheme("s3", "chunkstore.backends.s3", "open_s3_store", "pip install 'chunkstore[s3]'")
for _scheme in ("peer", "peer+redis", "peer+file"):
    register_scheme(
        _scheme,
        "chunkstore.backends.peer.store",
        "open_peer_store",
        "pip install 'chunkstore[peer]'",
    )
