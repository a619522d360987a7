"""Checks of user-given config values: each raises `ValueError` naming the field and what it accepts. Numbers must
be finite (NaN and infinities are refused, not clamped)."""

from __future__ import annotations

import math


def choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}.")


def integer(name: str, value, minimum: int = 1, allow_none: bool = False) -> None:
    """An int (not a bool, not a float such as 2.5 or 16.0) >= `minimum`, or None where allowed."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        none = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be an integer >= {minimum}{none}, got {value!r}.")


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def number(name: str, value) -> None:
    if not _finite_number(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")


def positive(name: str, value, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = _finite_number(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        none = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be a finite number {bound}{none}, got {value!r}.")


def boolean(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")


def within(name: str, value, bounds: str | None, allow_none: bool = False) -> None:
    """A finite number in `bounds` (an interval written as "(0, 1]", "[0, 1]", ...), or > 0 where None."""
    if bounds is None:
        return positive(name, value, allow_none)
    number(name, value)
    low, high = (float(x) for x in bounds[1:-1].split(","))
    if not ((value >= low if bounds[0] == "[" else value > low) and (value <= high if bounds[-1] == "]" else value < high)):
        raise ValueError(f"`{name}` must be in {bounds}, got {value!r}.")
