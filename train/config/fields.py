"""The building blocks of a config dataclass: a field with its default and doc, and the checks that name the field,
the value and what is allowed (the schema, train/config/schema.py, and machines.json's Machine use them)."""
from __future__ import annotations

import json
import typing
from dataclasses import field
from typing import Any

from train.core.errors import ConfigError


def doc(default: Any, text: str, **kw: Any) -> Any:
    """A dataclass field with a default and a doc string (lists/dicts are copied per instance)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata={"doc": text, **kw})
    return field(default=default, metadata={"doc": text, **kw})


def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations, resolved (the schema modules use postponed annotations)."""
    return typing.get_type_hints(cls)


def literal_choices(typ: Any) -> tuple[str, ...]:
    """The values of a `Literal[...]` annotation (also inside `Optional`), () for any other type."""
    if typing.get_origin(typ) is typing.Literal:
        return typing.get_args(typ)
    for arg in typing.get_args(typ):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return ()


class FieldError(ConfigError):
    """A bad value of one field: `<key> = <value>: <what is allowed>`.

    `key` is the field's dotted name as the schema spells it, or a part of one (`edt.genes.inner_lr`,
    `edt.initial_population[1]`): the loader puts the name the user wrote in front of the message when that was a
    prototype alias (`POPULATION_SIZE: edt.population_size = -1: must be >= 0`)."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(f"{key} = {json.dumps(value)}: {allowed}")
        self.key = key


def bad_value(name: str, value: Any, allowed: str) -> FieldError:
    return FieldError(name, value, allowed)


def check_range(obj: Any, prefix: str, name: str, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> None:
    v = getattr(obj, name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad_value(f"{prefix}{name}", v, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v > hi:
        raise bad_value(f"{prefix}{name}", v, f"must be <= {hi}")


def check_choice(obj: Any, prefix: str, name: str, choices: tuple[str, ...] | None = None) -> None:
    """`name` is one of `choices`, by default the values of its `Literal[...]` annotation."""
    if choices is None:
        choices = literal_choices(field_types(type(obj))[name])
    v = getattr(obj, name)
    if v not in choices:
        raise bad_value(f"{prefix}{name}", v, f"must be one of {', '.join(choices)}")


def check_span(obj: Any, prefix: str, name: str, lo: float, hi: float) -> None:
    """A [low, high] range of numbers within [lo, hi]."""
    v = getattr(obj, name)
    if (not isinstance(v, list) or len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                       for x in v) or not lo <= v[0] <= v[1] <= hi):
        raise bad_value(prefix + name, v, f"must be [low, high] with {lo} <= low <= high <= {hi}")
