"""Discovery's walk: the containers of the modules' namespaces and of the objects found there.

Namespaces are read through the interpreter's own `__dict__` descriptors, so no code of the
program runs; each container name met keeps a record of integers in its module's array (its
length and step in rings over the last passes, its growth flags, its size when last sized), and
the growers of a walk are kept as paths to find them again, never as the containers.
"""

from __future__ import annotations

import heapq
import re
import sys
import types
from array import array
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sized
from typing import Any, Callable, Optional, Protocol, cast

from gpuwatch.agent._graphs import graph
from gpuwatch.protocol import AUTOGRAD_SUFFIX
from gpuwatch.protocol import MAX_DISCOVERED_NAME as MAX_NAME

#: Objects handled between two reads of the clock.
CHECK_EVERY = 64
# Growers kept through a pass for sizing and ranking: a bounded heap, whatever the program.
_MAX_CANDIDATES = 64

_CONTAINER_BASES: tuple[type[Sized], ...] = (dict, list, set, deque, bytearray)
# Never looked into, though they have a __dict__: a function's holds its attributes, not state;
# modules are walked from sys.modules; classes only where they are defined.
_OPAQUE: tuple[type, ...] = (types.ModuleType, types.FunctionType, types.MethodType,
                             staticmethod, classmethod)
_RAW_DICT_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.:/<>-]")

# The interpreter's own descriptors: read through these, no metaclass, property or __getattr__
# of the object runs.
_type_dict: Callable[[type], Mapping[str, Any]] = vars(type)["__dict__"].__get__
_type_mro: Callable[[type], tuple[type, ...]] = vars(type)["__mro__"].__get__
_type_module: Callable[[type], Any] = vars(type)["__module__"].__get__
_module_dict: Callable[[Any], Any] = vars(types.ModuleType)["__dict__"].__get__

_SKIP, _CONTAINER, _CLASS, _INSTANCE, _TENSOR = 0, 1, 2, 3, 4
_Kind = tuple[int, Optional[Callable[[Any], Any]]]

# A record, _WIDTH ints per container name in its module's array: the pass it was last met in,
# the growth flags of its last 4 passes (bit 0 the latest), bytes and items when last sized (-1:
# never), then its length and the step of the last 5 passes in rings indexed by pass number
# modulo 5. A name not met in a pass is forgotten, so a record's passes are consecutive.
_SEEN, _BITS, _BYTES, _BYTES_ITEMS, _LEN, _STEP = 0, 1, 2, 3, 4, 9
_RING = 5
_WIDTH = _STEP + _RING
_NO_RECORDS: tuple[dict[str, int], array[int]] = ({}, array("q"))
# 4-bit flag sets with at least 3 bits set.
_THREE_OF_FOUR = frozenset(b for b in range(16) if bin(b).count("1") >= 3)


def _refcount_baseline() -> int:
    """What sys.getrefcount() says, in the walk, of an object that one namespace alone holds.

    Such an object cannot be met twice in a pass, so its id need not be remembered: most
    containers are held by one namespace only, and the set of ids stays small. -1 where
    reference counts are not known (the id of every object is remembered then).
    """
    getrefcount = getattr(sys, "getrefcount", None)
    if getrefcount is None:
        return -1

    def probe(ns: dict[str, Any]) -> Iterator[int]:
        for key in list(ns):
            value = ns.get(key)  # the walk's shape: a local of a generator's frame
            yield getrefcount(value)

    try:
        return next(probe({"k": []}))
    except Exception:
        return -1


_REFCOUNT_BASELINE = _refcount_baseline()
_getrefcount: Callable[[Any], int] = getattr(sys, "getrefcount", lambda obj: 1 << 62)


def _tensor_type() -> Optional[type]:
    """torch.Tensor where the program has imported torch (never imported here), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        ns = _module_dict(torch)
        tensor = ns.get("Tensor") if type(ns) is dict else None
    except Exception:
        return None
    return tensor if isinstance(tensor, type) else None


def _classify(t: type) -> _Kind:
    """What to do with an object of type `t`, and how: the len() of a container (the base class's,
    so that a __len__ of a subclass never runs), the raw __dict__ getter of an instance; for a
    plain torch.Tensor (not a subclass, whose attributes may run code of the program), the getter
    of its `grad_fn`, torch's own descriptor."""
    try:
        if t is _tensor_type():
            for klass in _type_mro(t):
                descriptor = _type_dict(klass).get("grad_fn")
                if descriptor is not None:
                    if type(descriptor) is types.GetSetDescriptorType:
                        return _TENSOR, cast(Any, descriptor).__get__
                    break
            return _SKIP, None
        # issubclass() of two types reads their MROs: no __subclasscheck__ of the program runs.
        for base in _CONTAINER_BASES:
            if issubclass(t, base):
                return _CONTAINER, (len if t is base else base.__len__)
        if issubclass(t, type):
            return _CLASS, None
        if issubclass(t, _OPAQUE):
            return _SKIP, None
        # The __dict__ slot's own descriptor, below any property a class puts in its place.
        for klass in _type_mro(t):
            descriptor = _type_dict(klass).get("__dict__")
            if type(descriptor) in _RAW_DICT_DESCRIPTORS:
                return _INSTANCE, cast(Any, descriptor).__get__
    except Exception:
        pass
    return _SKIP, None


def _namespace(obj: Any) -> Optional[Mapping[str, Any]]:
    """The attribute dict of a module, class or instance, read without getattr; None if none."""
    try:
        if issubclass(type(obj), types.ModuleType):
            ns = _module_dict(obj)
            return ns if type(ns) is dict else None
        kind, getter = _classify(type(obj))
        if kind == _CLASS:
            return _type_dict(obj)
        if kind == _INSTANCE and getter is not None:
            ns = getter(obj)
            return ns if type(ns) is dict else None
    except Exception:
        pass
    return None


#: A growing container met by a walk: (items per step, qualified name, path to find it again,
#: length, name in its module, the training step it was counted at): paths, never containers.
Grower = tuple[float, str, tuple[str, ...], int, str, int]


class _Walk:
    """One walk over a list of modules (the program's own, or the library's), and the module it
    is in: that module's records and its visit number, and the ring slots that visit uses."""

    __slots__ = ("candidates", "held", "here", "ids", "modules", "objects", "ring", "seen")

    def __init__(self) -> None:
        self.candidates: list[Grower] = []
        self.ids: set[int] = set()
        self.modules = self.objects = 0
        self.here: dict[str, int] = {}
        self.held: array[int] = array("q")
        self.seen = 0
        self.ring: tuple[int, ...] = _RINGS[0]


# The ring slots of a module's visit number v (modulo 5): its length now, at the visit before,
# 4 visits before (the slot v + 1 is about to be overwritten), its step now and 4 visits before.
class ScannerState(Protocol):
    """What the walk and the ranking read and keep of the scanner (gpuwatch.agent._discovery
    .Scanner is one): its records and counters, named here so that they need not import it."""

    _records: dict[str, tuple[dict[str, int], array[int]]]
    _visits: dict[str, int]
    _tracked: int
    _max_records: int
    _ignored: int
    _kinds: dict[type, _Kind]
    _skip: set[type]
    _step: int
    _pass: int
    _graphs: dict[str, tuple[int, int, int]]
    _top: int
    _modules: Optional[Mapping[str, types.ModuleType]]
    _growers: dict[str, dict[str, int]]
    _library_walk: Optional[_Walk]
    _library_done: list[Grower]
    _own_candidates: list[Grower]

    def _module_dicts(self) -> Mapping[str, Any]: ...


_RINGS = tuple(tuple(r + (v + k) % _RING for r, k in ((_LEN, 0), (_LEN, -1), (_LEN, 1),
                                                       (_STEP, 0), (_STEP, 1)))
               for v in range(_RING))


def walk_modules(sc: ScannerState, walk: _Walk, names: list[str], units: int
                 ) -> Generator[None, None, int]:
    modules = sc._module_dicts()
    records, visits = sc._records, sc._visits
    # A module under two names (os.path, posixpath) is walked once, as the first.
    namespaces: set[int] = set()
    for modname in names:
        try:
            module = modules.get(modname)
            ns = _module_dict(module) if issubclass(type(module), types.ModuleType) else None
            module = None
        except Exception:
            continue
        if type(ns) is not dict or id(ns) in namespaces:
            continue
        namespaces.add(id(ns))
        walk.modules += 1
        visit = walk.seen = visits.get(modname, 0) + 1
        visits[modname] = visit
        walk.ring = _RINGS[visit % _RING]
        entry = records.get(modname)
        if entry is None:
            entry = records[modname] = ({}, array("q"))
        here, held = walk.here, walk.held = entry
        # Classes are the module's own by the name they were defined in, which an alias of
        # the module does not have.
        owner = ns.get("__name__")
        units = yield from walk_namespace(
            sc, walk, ns, owner if type(owner) is str else modname, "", (modname,), True, 2,
            units)
        ns = None
        # Names of this module not met in this visit are forgotten. The dict changes only
        # here, so its iteration can span slices.
        stale = 0
        for offset in here.values():
            units += 1
            if units >= CHECK_EVERY:
                units = 0
                yield
            if held[offset + _SEEN] != visit:
                stale += 1
        if records.get(modname) is not entry:
            continue  # forgotten meanwhile (the module went): so are these
        if stale:
            kept: dict[str, int] = {}
            compact = array("q")
            for name, offset in here.items():
                if held[offset + _SEEN] == visit:
                    kept[name] = len(compact)
                    compact.extend(held[offset:offset + _WIDTH])
            records[modname] = (kept, compact)
            sc._tracked -= stale
            here = kept
        if not here:
            del records[modname]
    walk.here, walk.held = {}, array("q")
    return units


def walk_namespace(sc: ScannerState, walk: _Walk, ns: Mapping[str, Any], owner: str, prefix: str,
                   path: tuple[str, ...], classes: bool, depth: int, units: int
                   ) -> Generator[None, None, int]:
    """Containers in `ns` (a module's, a class's or an instance's dict) and below it.

    `walk`: the walk and the module it is in; `owner`: the name the module's classes were
    defined under; `prefix`: the names that led here from the module ("" in the module
    itself, else ending in "."), and `path` the same with the module's name first;
    `classes`: the classes defined in `owner` found here are looked into (a module's
    namespace); `depth`: how many levels of instances below this one are looked into (2 for
    a module or a class, 1 for an instance found there, 0 one level further); `units`: work
    done since the last yield, returned updated, so that nested walks share one count. Only
    the keys are copied, and no value is held across a yield: between slices this holds no
    container.
    """
    try:
        keys = list(ns)
        get = ns.get
    except Exception:
        return units
    kinds, skip, ids = sc._kinds, sc._skip, walk.ids
    baseline = _REFCOUNT_BASELINE
    # The records of this module, keyed by the names from the module on: the module's own
    # name and the protocol's characters are added to the few that grow only.
    here, held = walk.here, walk.held
    p, step = walk.seen, sc._step
    now, before, old, step_now, step_old = walk.ring
    value: Any = None
    inner: Any = None
    try:
        for key in keys:
            units += 1
            if units >= CHECK_EVERY:
                units = 0
                value = inner = None
                yield
                step = sc._step  # a new slice, perhaps a new step
            if type(key) is not str or key.startswith("__"):
                continue
            try:
                value = get(key)
                t = type(value)
                if t in skip:
                    continue
                kind = kinds.get(t)
                if kind is None:
                    kind = kinds[t] = _classify(t)
                    if kind[0] == _SKIP:
                        skip.add(t)
                        continue
                what, how = kind
                if what == _CLASS:
                    # A class's own attributes, where it is defined, not where imported.
                    if not classes:
                        continue
                    defined_in = _type_module(value)
                    if type(defined_in) is not str or defined_in != owner:
                        continue
                elif what == _INSTANCE and depth == 0:
                    continue
                if _getrefcount(value) != baseline:  # held elsewhere too: may be met again
                    i = id(value)
                    if i in ids:
                        continue
                    ids.add(i)
                if what in (_CONTAINER, _TENSOR):
                    if what == _CONTAINER:
                        n = how(value)  # type: ignore[misc]
                        name = prefix + key
                    else:
                        name = prefix + key + AUTOGRAD_SUFFIX
                        # Held by no local: a graph is never kept across a yield.
                        n, cost = graph(sc._graphs, sc._pass, f"{path[0]}.{name}",
                                        how(value))  # type: ignore[misc]
                        value = None
                        units += cost
                        if n < 0:
                            continue
                    value = None
                    r = here.get(name)
                    if r is None or held[r + _SEEN] == p:
                        track_new(sc, walk, name, n, r)
                        continue
                    # Inline, as this runs for every container of the program each pass.
                    held[r + _SEEN] = p
                    bits = ((held[r + _BITS] << 1) | (n > held[r + before])) & 15
                    held[r + _BITS] = bits
                    held[r + now] = n
                    held[r + step_now] = step
                    # A graph's count is exact and grows only as it extends the graph of
                    # the last pass: one pass of growth says it, where a container's length
                    # needs 3 of 4 to be told from one that jitters.
                    if (bits & 1 if what == _TENSOR else bits in _THREE_OF_FOUR) and (
                            n > held[r + old]):
                        grows(sc, walk, (n - held[r + old])
                              / max(1, step - held[r + step_old]),
                              (*path, key), name, n, step)
                    continue
                if what == _CLASS:
                    inner = _type_dict(value)
                else:
                    inner = how(value)  # type: ignore[misc]
                    if type(inner) is not dict:
                        continue
            except Exception:
                continue
            value = None
            # A class's instances are looked into as deep as a module's.
            units = yield from walk_namespace(
                sc, walk, inner, owner, prefix + key + ".", (*path, key), False,
                depth if what == _CLASS else depth - 1, units)
            inner = None
            step = sc._step
    finally:
        walk.objects += len(keys)
    return units


def track_new(sc: ScannerState, walk: _Walk, name: str, n: int, offset: Optional[int]) -> None:
    """A container name not met yet in this visit (`offset` None): a new record, if there
    is room for it."""
    if offset is not None:
        return  # two containers under one name: the first met keeps it
    if sc._tracked >= sc._max_records:
        sc._ignored += 1
        return
    step = sc._step
    held = walk.held
    walk.here[name] = len(held)
    held.extend((walk.seen, 0, -1, -1, n, n, n, n, n, step, step, step, step, step))
    sc._tracked += 1


def grows(sc: ScannerState, walk: _Walk, rate: float, path: tuple[str, ...], name: str, n: int,
          step: int) -> None:
    """A grower, gaining `rate` items per step, `n` long at training step `step`: kept if among
    the fastest of this walk."""
    qualified = _BAD_CHARS.sub("_", f"{path[0]}.{name}")
    # The tail names the container; the module path in front matters less.
    entry: Grower = (rate, qualified[-MAX_NAME:], path, n, name, step)
    candidates = walk.candidates
    if len(candidates) < _MAX_CANDIDATES:
        heapq.heappush(candidates, entry)
    elif entry > candidates[0]:
        heapq.heapreplace(candidates, entry)
