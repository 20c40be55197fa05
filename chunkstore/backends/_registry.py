"""``open_store(url)``: URL schemes to store classes, with lazy imports of optional backends.

:func:`check_url` says whether a URL can name a store here, without opening anything.
It can when its scheme is known and the scheme's extras are installed.
So configuration is checked when it is parsed.
Every failure to open is one line.
:func:`open_store` turns whatever a backend raises into a
:class:`~chunkstore.errors.StoreError` naming the URL.
A refused connection or an unknown host are examples.
:func:`open_for_option` also names the option the URL was given in.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkstore.backends.base import Store
from chunkstore.errors import (
    ChunkStoreError,
    ConfigError,
    KeyParseError,
    MissingDependency,
    StoreError,
)

# scheme -> (module, factory attribute, install hint). Modules import lazily so that a
# missing optional dependency only matters to users of that scheme (fsspec registry style).
_SCHEMES: dict[str, tuple[str, str, str]] = {
    "memory": ("chunkstore.backends._memory", "MemoryStore", ""),
}
_REQUIRES: dict[str, tuple[str, ...]] = {}
"""scheme -> modules its store needs, checked by :func:`check_url` without importing them."""
_FALLBACK: tuple[str, str, str] | None = None
IN_PROCESS_SCHEMES = frozenset({"memory"})
"""Schemes whose stores live inside one process: each open is a new, empty store."""


def register_scheme(
    scheme: str, module: str, attribute: str, hint: str = "", requires: tuple[str, ...] = ()
) -> None:
    """Map URL ``scheme`` to ``module.attribute``, a callable ``(url, **options) -> Store``.

    ``requires`` names the importable modules the store needs.
    :func:`check_url` checks them without importing them.
    ``hint`` says how to install them.
    """
    _SCHEMES[scheme] = (module, attribute, hint)
    _REQUIRES[scheme] = requires


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


def _scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def check_url(url: Any, *, in_process: bool = True) -> None:
    """Whether ``url`` can name a store here, without opening anything.

    Raises :class:`ConfigError` for an empty URL or an unknown scheme.
    With ``in_process=False`` it raises it for a ``memory://`` URL too.
    That is for configuration read by several processes.
    It is also for a CLI run that ends before anyone reads the store.
    Raises :class:`MissingDependency` when the scheme's extra is not installed.
    Chained fsspec URLs, such as ``simplecache::s3://...``, are checked part by part.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"a store URL must be a non-empty string, got {url!r}")
    for part in url.split("::"):
        scheme = _scheme_of(part)
        if scheme in ("", "file"):
            continue
        if scheme in IN_PROCESS_SCHEMES and not in_process:
            raise ConfigError(
                f"{url}: {scheme}:// stores live inside one process; "
                "use a directory, file://, s3:// or another fsspec URL"
            )
        if scheme in _SCHEMES:
            _require(url, _REQUIRES.get(scheme, ()), _SCHEMES[scheme][2])
        else:
            _check_fsspec_scheme(url, scheme)


def _require(url: str, modules: tuple[str, ...], hint: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        message = f"{url} needs {', '.join(missing)}, which is not installed"
        raise MissingDependency(f"{message}: {hint}" if hint else message)


def _check_fsspec_scheme(url: str, scheme: str) -> None:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        raise MissingDependency(f"{url} needs fsspec: pip install fsspec") from None
    if scheme in registry:
        return
    known = known_implementations.get(scheme)
    if known is None:
        raise ConfigError(
            f"{url}: unknown URL scheme {scheme}:// (use a directory, file://, s3://, "
            "peer:// or another fsspec URL)"
        )
    package = str(known.get("class", "")).split(".", 1)[0]
    if package:
        _require(url, (package,), str(known.get("err", "")))


def open_store(url: str, *, config: str | Path | None = None, **options: Any) -> Store:
    """Open the store at ``url``.

    ``url`` is ``memory://``, ``file:///path`` or a bare path, or ``s3://bucket/prefix``.
    Any other fsspec URL works too.
    Options come from keyword arguments, or from a JSON or YAML file named by ``config``.
    Keyword arguments win.
    Every failure is a :class:`~chunkstore.errors.ChunkStoreError`.
    Its one-line message names the URL.
    An unreachable endpoint is a :class:`~chunkstore.errors.StoreError`.
    A refused connection or an unknown host are such endpoints.
    The backend's own exception never escapes.
    """
    check_url(url)
    merged = {**load_options(config), **options}
    scheme = _scheme_of(url)
    try:
        if scheme in _SCHEMES:
            factory = _resolve(_SCHEMES[scheme])
            if scheme in IN_PROCESS_SCHEMES:
                return factory(**merged)
            return factory(url, **merged)
        if _FALLBACK is None:
            raise ConfigError(f"no store handles {url!r}")
        return _resolve(_FALLBACK)(url, **merged)
    except ChunkStoreError:
        raise
    except TypeError as exc:
        # A store factory rejecting an option name is a user mistake, not a crash.
        raise ConfigError(f"bad store option for {url}: {_one_line(exc)}") from None
    except ImportError as exc:
        raise MissingDependency(f"{url} needs a missing package: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - whatever a backend raises, the user gets one line
        raise StoreError(f"cannot open {url}: {type(exc).__name__}: {_one_line(exc)}") from None


def open_for_option(option: str, url: Any, *, in_process: bool = False, **options: Any) -> Store:
    """:func:`open_store` for a URL given in configuration option ``option``, like ``tiers``.

    Every failure is one line naming the option and the URL.
    Its class says what to do.
    :class:`ConfigError`: fix the URL or an option.
    :class:`MissingDependency`: install an extra.
    :class:`StoreError`: the store cannot be reached or opened.
    ``in_process=False`` refuses ``memory://``.
    """
    try:
        check_url(url, in_process=in_process)
        return open_store(url, **options)
    except ChunkStoreError as exc:
        raise naming_option(exc, option, url) from None


def naming_option(exc: ChunkStoreError, option: str, url: Any) -> ChunkStoreError:
    """``exc`` again, its message prefixed with the option (and the URL if it lacks it)."""
    text = _one_line(exc)
    if not isinstance(url, str) or url not in text:
        text = f"{url!r}: {text}" if not isinstance(url, str) else f"{url}: {text}"
    message = f"{option}: {text}"
    if isinstance(exc, MissingDependency):
        return MissingDependency(message)
    if isinstance(exc, (ConfigError, KeyParseError)):
        return ConfigError(message)
    return StoreError(message)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


set_fallback("chunkstore.backends._fs", "open_fs_store")
register_scheme(
    "s3", "chunkstore.backends._s3", "open_s3_store", "pip install 'chunkstore[s3]'", ("s3fs",)
)
# The peer package sits above backends and cache (a peer server serves a host cache), so its
# store is named here by module path and imported only when a peer URL is opened.
for _scheme, _requires in (
    ("peer", ("zmq", "msgpack")),
    ("peer+redis", ("zmq", "msgpack", "redis")),
    ("peer+file", ("zmq", "msgpack")),
):
    register_scheme(
        _scheme,
        "chunkstore.peer._store",
        "open_peer_store",
        "pip install 'chunkstore[peer]'",
        _requires,
    )
