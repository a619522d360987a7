"""The machinery of `EngineConfig`'s nested sections: one setting, one name, from the trainer flag to its reader.

A `Section` is a frozen dataclass of settings; `flag_prefix` + a field's name is the setting's *flag*: the keyword of
the flat form `EngineConfig(kv_cache_tokens=...)`, the trainer field `rollout_kv_cache_tokens`, the name every
`ValueError` about it gives. Each setting is declared with `setting(default, help, readers, ...)`: `readers` names
the modules (under `trl_infinite/`) that read it (`tests/engine/config/test_config.py` checks they do, and that nothing else
reads it through its section); the rest, what its value is checked against. A nested section is `section(Cls)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trl_infinite.engine.config.validate import boolean, choice, integer, within


@dataclass(frozen=True)
class Section:
    """Base of every group of settings (see the module docstring)."""

    flag_prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        """Each setting checked against its declaration (`setting`) and type: `bool`, `int` (>= `minimum`), `float`
        (finite, in `bounds`), `| None` allowing None; a `ValueError` names the flag. Sections add the checks that
        involve several settings after this one."""
        for f in dataclasses.fields(self):
            meta, value, name, optional = f.metadata, getattr(self, f.name), self.flag(f.name), "None" in f.type
            if "readers" not in meta or (value is None and optional):
                continue
            if meta["choices"] is not None:
                choice(name, value, meta["choices"])
            elif f.type.startswith("bool"):
                boolean(name, value)
            elif f.type.startswith("int"):
                integer(name, value, meta["minimum"], optional)
            elif f.type.startswith("float"):
                within(name, value, meta["bounds"], optional)

    def flag(self, name: str) -> str:
        """The user-facing name of this section's setting `name` (`ValueError`s name it)."""
        return self.flag_prefix + name


def setting(default: Any, help: str, readers: tuple[str, ...], minimum: int = 1, bounds: str | None = None,
            choices=None) -> Any:
    """A setting: its default, its help (the trainer flag's too), the modules that read it, and what its value is
    checked against: `minimum` (an `int`), `bounds` (a `float`: an interval such as "(0, 1]"; None: > 0), `choices`
    (a tuple, or a plug-in registry: its names)."""
    return field(default=default, metadata={"help": help, "readers": readers, "minimum": minimum, "bounds": bounds,
                                            "choices": choices})


def section(cls: type) -> Any:
    """A nested section, built with its defaults when not given."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(frozen=True)
class Flag:
    """One setting of a config class: its flag name, its path of attributes, its dataclass field and section."""

    name: str
    path: tuple[str, ...]
    field: dataclasses.Field
    owner: type

    @property
    def readers(self) -> tuple[str, ...]:
        return self.field.metadata["readers"]

    @property
    def default(self) -> Any:
        return self.field.default


def flags(cls: type, path: tuple[str, ...] = ()) -> list[Flag]:
    """Every setting of `cls` and of its nested sections, depth first in declaration order."""
    out: list[Flag] = []
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("section")
        if sub is not None:
            out.extend(flags(sub, (*path, f.name)))
        else:
            out.append(Flag(cls.flag_prefix + f.name, (*path, f.name), f, cls))
    return out


def with_flags(cls: type, given: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The field values of `cls` from `given` (fields and sections by name) with the flat `values` (flag names)
    applied on top, sections rebuilt (so validated) where a flag changed them. Consumes the flags it uses from
    `values`."""
    out = {}
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("section")
        current = given.get(f.name, f.default if sub is None else None)
        if sub is None:
            out[f.name] = values.pop(cls.flag_prefix + f.name, current)
        elif any(g.name in values for g in flags(sub)):
            inner = {} if current is None else {g.name: getattr(current, g.name) for g in dataclasses.fields(sub)}
            out[f.name] = sub(**with_flags(sub, inner, values))
        else:
            out[f.name] = sub() if current is None else current
    return out
