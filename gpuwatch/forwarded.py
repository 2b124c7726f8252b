"""`Forwarded`: a read-only attribute an object takes from one of its parts.

`max_points = Forwarded[int]("store")` in a class body makes `x.max_points` read
`x.store.max_points`: what a class shows of the parts it is made of, said once a name, typed, and
never a copy that could fall out of step with the part.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Forwarded(Generic[T]):
    """Reads the attribute of the same name of the owner's attribute `part`."""

    __slots__ = ("name", "part")

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Forwarded[T]: ...

    @overload
    def __get__(self, instance: object, owner: type) -> T: ...

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        return getattr(getattr(instance, self.part), self.name)

    def __set__(self, instance: object, value: object) -> None:
        # Read-only, as a property without a setter is: the part's attribute is set on the part.
        raise AttributeError(f"{self.name} is {self.part}.{self.name}: set it there")
