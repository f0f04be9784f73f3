"""`package.module:name` specs: how a config names user code (edt.fitness, a task metric) and the strategy table
names its classes. One loader, so every such key accepts the same form."""
from __future__ import annotations

import importlib
from typing import Any


def import_attr(spec: str) -> Any:
    """The object `spec` = "package.module:name" names; ImportError / AttributeError (a ValueError for a spec
    without ":") for the caller to turn into its own message."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"{spec!r} is not of the form package.module:name")
    return getattr(importlib.import_module(mod), attr)
