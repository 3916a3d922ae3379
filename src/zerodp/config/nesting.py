"""Nested configuration policies: the generic part.

[Note: nested policies]
``ZeroConfig`` holds its settings by concern: a few flat fields, and one frozen dataclass per
concern (``Precision``, which holds ``LossScaling``; ``Stage3``). Each of these is a ``Policy``:
a frozen ``kw_only`` slots dataclass that validates its own fields in ``__post_init__``, names
them by ``PATH`` (where ``ZeroConfig`` holds it, so messages read "ZeroConfig.precision.reduce
must be ..." even for a ``Precision`` built on its own), and is found by the code below through
its field's default: a field whose ``default_factory`` is a ``Policy`` class holds that
policy. So adding a policy is its class, one field ``name: Cls = field(default_factory=Cls)``
in its parent, and ``coerce_policies(self)`` in the parent's ``__post_init__``; parsing from
dicts (``from_mapping``), ``to_dict`` (``dataclasses.asdict``) and error paths need nothing
more.

A policy may accept a *shorthand*: a string given where the policy is expected stands for the
policy with only its ``SHORTHAND`` field set (``ZeroConfig(precision="bf16")`` is
``ZeroConfig(precision=Precision(compute="bf16"))``: the most common setting stays one word).
Dicts become policies only in ``from_mapping`` (``from_dict`` / ``from_json``); the constructor
takes the policy objects, as its type says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

P = TypeVar("P", bound="Policy")


class Policy:
    """Base of ``ZeroConfig`` and its nested policies (dataclasses)."""

    __slots__ = ()
    PATH: ClassVar[str]
    """Where ``ZeroConfig`` holds the policy: ``"ZeroConfig.precision"``; the root is
    ``"ZeroConfig"``."""
    SHORTHAND: ClassVar[str | None] = None
    """The field a string given for this policy sets (``None``: no shorthand)."""


def policy_fields(cls: type[Policy]) -> dict[str, type[Policy]]:
    """The fields of ``cls`` that hold a nested policy, and the policy's class."""
    found: dict[str, type[Policy]] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        make = f.default_factory
        if isinstance(make, type) and issubclass(make, Policy):
            found[f.name] = make
    return found


def field_names(cls: type[Policy]) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]


def coerce_policies(policy: Policy) -> None:
    """In ``__post_init__``: make every nested-policy field of ``policy`` hold its policy
    (a shorthand string becomes one), or raise naming the field."""
    for name, cls in policy_fields(type(policy)).items():
        value = getattr(policy, name)
        if not isinstance(value, cls):
            # Frozen: __post_init__ may set a field only through object.__setattr__.
            object.__setattr__(policy, name, from_shorthand(cls, value))


def from_shorthand(cls: type[P], value: object) -> P:
    if cls.SHORTHAND is not None and isinstance(value, str):
        return cls(**{cls.SHORTHAND: value})
    short = f" or a string (short for {cls.__name__}({cls.SHORTHAND}=...))" if cls.SHORTHAND else ""
    raise ValueError(f"{cls.PATH} must be a {cls.__name__}{short}; got {value!r}")


def from_mapping(cls: type[P], values: Mapping[str, Any]) -> P:
    """``cls`` from a dict of its fields, nested policies given as dicts too (JSON)."""
    check_keys(cls, values)
    kwargs = dict(values)
    for name, sub in policy_fields(cls).items():
        if isinstance(kwargs.get(name), Mapping):
            kwargs[name] = from_mapping(sub, kwargs[name])
    return cls(**kwargs)


def check_keys(cls: type[Policy], values: object) -> None:
    """Unknown keys are refused, not ignored: a typo in a JSON file must not silently leave
    the default in place."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{cls.PATH} must be given as a dict of its fields; got {values!r}")
    allowed = field_names(cls)
    unknown = sorted(map(str, set(values) - set(allowed)))
    if unknown:
        raise ValueError(f"{cls.PATH} got unknown field(s) {unknown}; allowed fields: {allowed}")
