"""A name -> plug-in registry shared by schedulers, admission policies, drafters and attention backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """`dict[str, T]` keyed by the name a user writes in a config field (`field`).

    `@REG.register("name")` adds a class or function (and sets `cls.name` on classes); `REG.get_or_raise(name)`
    raises a `ValueError` that names the config field and the registered choices.
    """

    def __init__(self, field: str):
        super().__init__()
        self.field = field

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            if isinstance(obj, type):
                obj.name = name
            self[name] = obj
            return obj

        return wrap

    def get_or_raise(self, name: str) -> T:
        if name not in self:
            raise ValueError(f"`{self.field}` must be one of {sorted(self)}, got {name!r}.")
        return self[name]
