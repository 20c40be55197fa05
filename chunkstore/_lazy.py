"""Names a package exports but imports on first use (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping


def lazy_attribute(package: str, modules: Mapping[str, str], name: str) -> object:
    """``name`` from the module ``modules[name]``; :class:`AttributeError` for any other name.

    A package's ``__getattr__`` calls it with its own name and table.
    """
    module = modules.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
