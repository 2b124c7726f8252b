"""`@frozen_dataclass`: `@dataclass(frozen=True)` that compiles three methods per class, not six.

On the Pythons gpuwatch supports before 3.13, dataclass compiles every method it generates from
source text: six for a frozen class (__init__, __repr__, __eq__, __hash__, __setattr__,
__delattr__). gpuwatch.config and gpuwatch.model define two dozen of them, and every command
imports the first, every poll the second (docs/design-notes.md, "The command line: click"). Here
__repr__, __eq__ and __hash__ are written once and shared, reading each class's fields with one
attrgetter; they behave as dataclass's own: fields with repr=False, compare=False or hash=False
are left out as dataclass leaves them out, and an instance equals only one of its own class.
"""

from __future__ import annotations

import operator
import reprlib
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, TypeVar

T = TypeVar("T")
Inst = TypeVar("Inst")
Asker = TypeVar("Asker")

if TYPE_CHECKING:
    # So that a type checker reads a decorated class as the frozen dataclass it is.
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Callable[[T], T]:
        return lambda f: f


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda o: (one(o),)
    if not names:
        return lambda o: ()
    return operator.attrgetter(*names)  # a tuple for two names or more


@dataclass_transform(frozen_default=True)
def frozen_dataclass(cls: type[T]) -> type[T]:
    # dataclass gives a class without a docstring its signature as one, through
    # inspect.signature (0.45 ms of gpuwatch.config's 3.4 ms import, which every command
    # pays); the fields' names say as much.
    undocumented = not cls.__doc__
    if undocumented:
        cls.__doc__ = cls.__name__
    cls = dataclass(frozen=True, repr=False, eq=False)(cls)
    fs = fields(cls)  # type: ignore[arg-type]
    if undocumented:
        cls.__doc__ = f"{cls.__name__}({', '.join(f.name for f in fs if f.init)})"
    shown = tuple(f.name for f in fs if f.repr)
    compared = tuple(f.name for f in fs if f.compare)
    hashed = tuple(f.name for f in fs if (f.compare if f.hash is None else f.hash))
    cls._gw_shown = (shown, _getter(shown))  # type: ignore[attr-defined]
    # staticmethod: a lambda read through an instance would otherwise bind to it.
    cls._gw_compared = staticmethod(_getter(compared))  # type: ignore[attr-defined]
    cls._gw_hashed = staticmethod(_getter(hashed))  # type: ignore[attr-defined]
    # What an instance keeps of itself beyond its fields (functools.cached_property): a copy
    # made by evolve() works it out again from its own fields.
    cls._gw_cached = tuple(name for name, value in vars(cls).items()  # type: ignore[attr-defined]
                           if isinstance(value, cached_property))
    cls.__repr__ = _repr  # type: ignore[assignment]
    cls.__eq__ = _eq  # type: ignore[assignment]
    cls.__hash__ = _hash  # type: ignore[assignment]
    return cls


@reprlib.recursive_repr()
def _repr(self: Any) -> str:
    names, values = self._gw_shown
    shown = ", ".join(f"{n}={v!r}" for n, v in zip(names, values(self)))
    return f"{self.__class__.__qualname__}({shown})"


def _eq(self: Any, other: object) -> Any:
    if other.__class__ is self.__class__:
        return self._gw_compared(self) == self._gw_compared(other)
    return NotImplemented


def _hash(self: Any) -> int:
    return hash(self._gw_hashed(self))


def evolve(instance: T, **changes: Any) -> T:
    """`dataclasses.replace` for an instance of a frozen dataclass without __post_init__ or
    slots, in a quarter of the time: the copy's fields are set from the instance's, without a call
    to __init__ (a poll makes one for each GPU holder it sees first)."""
    names = instance.__dataclass_fields__.keys()  # type: ignore[attr-defined]
    # Name by name: a set difference would copy every field name at each call.
    if not changes.keys() <= names:
        unknown = ", ".join(sorted(changes.keys() - names))
        raise TypeError(f"{type(instance).__name__} has no field {unknown}")
    copy = object.__new__(type(instance))
    kept = copy.__dict__
    kept.update(instance.__dict__, **changes)
    for name in getattr(instance, "_gw_cached", ()):
        kept.pop(name, None)
    kept.pop(_MEMO, None)
    return copy


#: Where `memo` keeps what was worked out of an instance (dropped by evolve, as cached
#: properties are).
_MEMO = "_gw_memo"


def memo(work: Callable[[Inst, Asker], T], instance: Inst, asker: Asker) -> T:
    """`work(instance, asker)`, for a pure function `work` of a frozen dataclass instance and
    of an `asker` (the settings a judgement depends on, compared by identity), worked out once:
    asked of one record several times a poll, and of the same record at every poll while its
    process does not change. One answer is kept per instance, for one function and its last
    asker; a copy made by evolve() keeps none."""
    kept = instance.__dict__.get(_MEMO)
    if kept is not None and kept[1] is asker and kept[0] is work:
        return kept[2]  # type: ignore[no-any-return]
    value = work(instance, asker)
    instance.__dict__[_MEMO] = (work, asker, value)
    return value


def build(cls: type[T], values: dict[str, Any]) -> T:
    """An instance of the frozen dataclass `cls` (without __post_init__ or slots) whose fields
    are `values`, every one of them given, taken as they are (the dict becomes the instance's):
    __init__ sets a frozen instance's fields one object.__setattr__ call at a time, a third of
    the cost of a new process's record."""
    names = cls.__dataclass_fields__.keys()  # type: ignore[attr-defined]
    if values.keys() != names:
        missing = ", ".join(sorted(names - values.keys()))
        unknown = ", ".join(sorted(values.keys() - names))
        raise TypeError(f"{cls.__name__}: fields not given: {missing or '-'}; "
                        f"no such field: {unknown or '-'}")
    instance = object.__new__(cls)
    object.__setattr__(instance, "__dict__", values)
    return instance
