"""Code the operator names in the configuration, as ``package.module:Attribute`` (the attribute
may be dotted: ``Class.from_config``): the classes of ``rate_limiters:`` and the factories of
``filters:``.

Guarantees: ``load_attribute`` returns what the name names or raises ValueError saying what is
wrong: the form, the import (an import error inside the plug-in is the operator's to see), or
the attribute.
"""

from __future__ import annotations

import importlib
from typing import Any


def load_attribute(target: str, form: str) -> Any:
    """What ``target`` (``package.module:Attribute``) names; ``form`` is how an error message
    spells the expected form (``package.module:ClassName``)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"must be {form}, got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error inside the plug-in is the operator's to see
        raise ValueError(f"cannot import {module_name!r} (from {target!r}): {exc!r}") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{module_name!r} has no {attr!r} (from {target!r})")
    return obj
