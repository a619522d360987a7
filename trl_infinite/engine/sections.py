"""The machinery of `EngineConfig`'s nested sections: one setting, one name, from the trainer flag to its reader.

A `Section` is a frozen dataclass of settings; `flag_prefix` + a field's name is the setting's *flag*: the keyword of
the flat form `EngineConfig(kv_cache_tokens=...)`, the trainer field `rollout_kv_cache_tokens`, the name every
`ValueError` about it gives. Each setting is declared with `setting(default, help, readers)`: `readers` names the
modules (under `trl_infinite/`) that read it (`tests/engine/test_config.py` checks they do, and that nothing else
reads it through its section); a nested section with `section(Cls)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Section:
    """Base of every group of settings (see the module docstring)."""

    flag_prefix: ClassVar[str] = ""

    def flag(self, name: str) -> str:
        """The user-facing name of this section's setting `name` (`ValueError`s name it)."""
        return self.flag_prefix + name


def setting(default: Any, help: str, readers: tuple[str, ...]) -> Any:
    """A setting: its default, its help (the trainer flag's too) and the modules that read it."""
    return field(default=default, metadata={"help": help, "readers": readers})


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

    def get(self, config) -> Any:
        for name in self.path:
            config = getattr(config, name)
        return config


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
        if sub is None:
            flag = cls.flag_prefix + f.name
            out[f.name] = values.pop(flag) if flag in values else given.get(f.name, f.default)
            continue
        current = given.get(f.name)
        inner = {g.name: getattr(current, g.name) for g in dataclasses.fields(sub)} if current is not None else {}
        names = {g.name for g in flags(sub)}
        if current is not None and not names & values.keys():
            out[f.name] = current
        elif current is None and not names & values.keys():
            out[f.name] = sub()
        else:
            out[f.name] = sub(**with_flags(sub, inner, values))
    return out
