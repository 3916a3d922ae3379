"""Value checks shared by ``ZeroConfig`` and its policies.

Each check reads one field of a policy and raises a ``ValueError`` naming it by its full path
(``ZeroConfig.precision.reduce``: ``Policy.PATH`` plus the field), so a bad value in a JSON file
or a call can be found without reading zerodp's source.
"""

from __future__ import annotations

from zerodp.config.nesting import Policy


def field_path(policy: Policy, name: str) -> str:
    return f"{type(policy).PATH}.{name}"


def check_choice(policy: Policy, name: str, allowed: tuple[object, ...]) -> None:
    value = getattr(policy, name)
    # bool is an int subclass: stage=True must not pass as stage=1.
    if isinstance(value, bool) or value not in allowed:
        choices = ", ".join(map(repr, allowed))
        raise ValueError(f"{field_path(policy, name)} must be one of {choices}; got {value!r}")


def check_positive_int(policy: Policy, name: str) -> None:
    value = getattr(policy, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field_path(policy, name)} must be a positive integer; got {value!r}")


def check_non_negative_int(policy: Policy, name: str) -> None:
    value = getattr(policy, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{field_path(policy, name)} must be a non-negative integer; got {value!r}"
        )


def check_positive_float(policy: Policy, name: str, optional: bool = False) -> None:
    """``optional``: ``None`` is allowed too (it means "off" or "not fixed")."""
    value = getattr(policy, name)
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or value != value:  # NaN
        raise ValueError(f"{field_path(policy, name)} must be a positive number; got {value!r}")


def check_bool(policy: Policy, name: str) -> None:
    value = getattr(policy, name)
    if not isinstance(value, bool):
        raise ValueError(f"{field_path(policy, name)} must be True or False; got {value!r}")


def check_in_range(policy: Policy, name: str, low: float, high: float | None) -> None:
    """``low < value`` and, when ``high`` is given, ``value < high`` (open bounds)."""
    value = getattr(policy, name)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and low < value and (high is None or value < high):
        return
    bound = f"in ({low:g}, {high:g})" if high is not None else f"> {low!r}"
    raise ValueError(f"{field_path(policy, name)} must be {bound}; got {value!r}")


def check_class_names(policy: Policy, name: str) -> None:
    """A tuple of non-empty module class names; a list (from JSON) becomes the tuple."""
    value = getattr(policy, name)
    if isinstance(value, list):
        value = tuple(value)
        object.__setattr__(policy, name, value)
    if not isinstance(value, tuple) or not all(isinstance(c, str) and c for c in value):
        raise ValueError(
            f"{field_path(policy, name)} must be a tuple of module class names; got {value!r}"
        )
