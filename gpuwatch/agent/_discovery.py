"""Discovery: find the containers of a program that grow, without being told about them.

What is walked, for every loaded module (sys.modules, read anew at each pass, or a given mapping of
names to modules), skipping entries that are not modules and modules whose name starts with one of
`exclude` (by default the agent itself):

- the module's globals (names starting with "__" skipped);
- the class-level attributes of the classes defined in that module;
- the `__dict__` of a long-lived object found there (a module-level or class-level instance, such
  as a client singleton), and the `__dict__` of the objects found in that one: two levels down.

A container is a dict, list, set, deque or bytearray, subclasses included; its items are never
looked into. Modules, classes (other than the module's own, as above), functions and builtins are
skipped. Names read "<module>.<attr>", "<module>.<Class>.<attr>" or
"<module>.<obj>.<attr>[.<attr>]", in the characters the protocol allows (others become "_"), the
last 128 characters of a longer one. An object reached twice in a pass counts once, under the name
it was first found by (sys.modules is in import order).

The walk runs no code of the program: namespaces are read through the interpreter's own
`__dict__` descriptors, never through getattr(), isinstance() or a len() that a subclass
overrides, so a lazy module's __getattr__, a property or a proxy never runs and nothing gets
imported. Only the few containers found growing are sized, by the agent's sampled measure, which
asks the container itself (len(), a sample of its items).

The budget: Scanner.slice() works for about `budget` seconds (default 2 ms) and the next slice
resumes where it stopped, so a pass over a large program takes several slices. The clock is read
every 64 objects; a slice runs late only by one piece of work that cannot be split, such as copying
the keys of one namespace or sizing one grower. Between slices the scanner holds the names still
to visit and the namespaces it is in, never a container: per container name it keeps integers.

The growth rule: a container is a grower when its length grew in at least 3 of its last 4 passes
and is now larger than 4 passes ago. A bounded cache drops out once it is full (one pass later), a
scratch list cleared each step never qualifies, nor does a registry filled once at import. Growers
are ranked by bytes per step (bytes per item, as last sized, times items gained per step; the 16
growers gaining items fastest are sized each pass), those never sized after them by items per
step, and the first `top` (default 8) are reported. At most 100,000 names are tracked, new ones
beyond are ignored; a name not met in a pass is forgotten.

Standard library only; nothing from gpuwatch is imported but the sizing function, on first use.
"""

from __future__ import annotations

import heapq
import re
import sys
import time
import types
from array import array
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sized
from typing import Any, Callable, Optional, cast

__all__ = ["MAX_RECORDS", "Scanner"]

#: Container names tracked at most; beyond, new names are ignored (and counted).
MAX_RECORDS = 100_000
#: Growers sized per pass, those gaining items fastest first.
MAX_SIZINGS = 16
#: Objects handled between two reads of the clock.
CHECK_EVERY = 64
#: The protocol's limit on a name's length.
MAX_NAME = 128
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

_SKIP, _CONTAINER, _CLASS, _INSTANCE = 0, 1, 2, 3
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

_measure: Optional[Callable[[Any], dict[str, int]]] = None


def _sizer() -> Optional[Callable[[Any], dict[str, int]]]:
    """The agent's sampled measure, imported on first use, from wherever it lives."""
    global _measure
    if _measure is None:
        try:
            from gpuwatch.agent._sizing import measure
        except ImportError:
            try:
                from gpuwatch.agent import (  # type: ignore[attr-defined, no-redef]
                    _measure as measure,
                )
            except Exception:
                return None  # growers are ranked by items then
        except Exception:
            return None
        _measure = measure
    return _measure


def _classify(t: type) -> _Kind:
    """What to do with an object of type `t`, and how: the len() of a container (the base class's,
    so that a __len__ of a subclass never runs), the raw __dict__ getter of an instance."""
    try:
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


class Scanner:
    """Finds the growing containers of the modules of a program, a budgeted slice at a time.

    `modules` maps module names to modules (default: sys.modules, read at each pass); `budget` is
    the work of one slice in seconds; `top` the number of growers reported; `exclude` the module
    name prefixes skipped (str.startswith); `max_records` the most container names tracked.
    """

    # No __dict__: a scanner kept at module level is never walked into, and never finds its own
    # records growing.
    __slots__ = ("_budget", "_candidates", "_exclude", "_growers", "_ids", "_ignored", "_kinds",
                 "_max_records", "_module_array", "_module_records", "_modules", "_objects",
                 "_pass", "_pass_modules", "_pass_seconds", "_pass_slices", "_records", "_ring",
                 "_round", "_skip", "_stats", "_step", "_top", "_tracked", "_walk")

    def __init__(self, modules: Optional[Mapping[str, types.ModuleType]] = None, *,
                 budget: float = 0.002, top: int = 8,
                 exclude: tuple[str, ...] = ("gpuwatch.agent",),
                 max_records: int = MAX_RECORDS) -> None:
        budget = float(budget)
        if not budget > 0:
            raise ValueError(f"budget must be > 0 seconds, got {budget!r}")
        if top < 0 or max_records < 0:
            raise ValueError(f"top and max_records must be >= 0, got {top!r}, {max_records!r}")
        self._modules = modules
        self._budget = budget
        self._top = int(top)
        self._exclude = tuple(str(prefix) for prefix in exclude)
        self._max_records = int(max_records)
        # Records by module, then by name: one dict of 100,000 names would take milliseconds
        # to resize, work that cannot be split; a module's own is small. The module walked now
        # has its dict in _module_records.
        # Per module: each name's offset into one array of the module's records. One array per
        # module, not one object per record: tens of thousands of records would be tracked by
        # the garbage collector, and the allocations of a first pass would set off a full
        # collection of the program's heap inside a slice (100 ms with 2,000 modules loaded).
        self._records: dict[str, tuple[dict[str, int], array[int]]] = {}
        self._module_records: dict[str, int] = {}
        self._module_array: array[int] = array("q")
        self._tracked = 0
        self._kinds: dict[type, _Kind] = {}
        self._skip: set[type] = set()  # the types classified _SKIP: most objects, one lookup
        self._ids: set[int] = set()
        # (items per step, qualified name, path to find it again, length, name in its module):
        # paths, never containers.
        self._candidates: list[tuple[float, str, tuple[str, ...], int, str]] = []
        self._walk: Optional[Iterator[None]] = None
        self._growers: dict[str, dict[str, int]] = {}
        self._pass = self._round = 0
        self._ring: tuple[int, ...] = (0, 0, 0, 0, 0)
        self._step = 0
        self._ignored = self._objects = self._pass_modules = self._pass_slices = 0
        self._pass_seconds = 0.0
        self._stats: dict[str, Any] = {"passes": 0, "candidates": 0, "last_pass_seconds": 0.0,
                                       "slices_last_pass": 0, "modules_last_pass": 0,
                                       "objects_last_pass": 0, "ignored": 0}

    # ---- public ----------------------------------------------------------------------------

    def slice(self, step: int, budget: Optional[float] = None) -> bool:
        """Work for about `budget` seconds (default: the scanner's) at training step `step`,
        resuming where the last slice stopped; True when this slice completed a pass. Never
        raises, but for KeyboardInterrupt and the like, after which the next slice starts a new
        pass."""
        start = time.perf_counter()
        deadline = start + (budget if budget is not None and budget > 0 else self._budget)
        if type(step) is int:
            self._step = step
        done = False
        try:
            walk = self._walk
            if walk is None:
                walk = self._walk = self._run_pass()
            clock = time.perf_counter
            while True:
                next(walk)
                if clock() >= deadline:
                    break
        except StopIteration:
            done = True
        except Exception:
            self._abandon()
        except BaseException:
            self._abandon()
            raise
        self._pass_seconds += time.perf_counter() - start
        self._pass_slices += 1
        if self._walk is None:  # abandoned: the next pass counts from zero
            self._pass_seconds, self._pass_slices = 0.0, 0
        elif done:
            self._walk = None
            self._stats = {"passes": self._pass, "candidates": self._tracked,
                           "last_pass_seconds": self._pass_seconds,
                           "slices_last_pass": self._pass_slices,
                           "modules_last_pass": self._pass_modules,
                           "objects_last_pass": self._objects, "ignored": self._ignored}
            self._pass_seconds, self._pass_slices = 0.0, 0
        return done

    def growers(self) -> dict[str, dict[str, int]]:
        """The growers found by the last completed pass, biggest first: qualified name ->
        {"items": n, "bytes": b}, bytes only where the container was sized in that pass."""
        return {name: dict(entry) for name, entry in self._growers.items()}

    @property
    def stats(self) -> dict[str, Any]:
        """As of the last completed pass: passes (completed), candidates (container names
        tracked), last_pass_seconds (its work time, over its slices), slices_last_pass,
        modules_last_pass, objects_last_pass (names looked at), ignored (container names not
        tracked for the bound on records)."""
        return dict(self._stats)

    # ---- the pass --------------------------------------------------------------------------

    def _abandon(self) -> None:
        # Something unforeseen broke the walk: the next slice starts a pass afresh. Some records
        # took this pass's figures and some not, so all are forgotten: growth is learnt again.
        self._walk = None
        self._records, self._module_records, self._tracked = {}, {}, 0
        self._module_array = array("q")
        self._ids, self._candidates, self._kinds, self._skip = set(), [], {}, set()

    def _run_pass(self) -> Generator[None, None, None]:
        """One pass, as a generator that yields every CHECK_EVERY objects for the clock."""
        # The rings are indexed by this count, which goes on through abandoned passes.
        self._round += 1
        p = self._round
        self._ring = tuple(r + (p + k) % _RING for r, k in ((_LEN, 0), (_LEN, -1), (_LEN, 1),
                                                            (_STEP, 0), (_STEP, 1)))
        # The caches hold types: emptied at each pass, they keep no discarded class alive long.
        self._kinds, self._skip = {}, set()
        self._ids = set()
        self._candidates = []
        self._objects = self._ignored = self._pass_modules = 0
        modules = self._modules if self._modules is not None else sys.modules
        try:
            names = list(modules)
        except Exception:
            names = []
        exclude = self._exclude
        records = self._records
        walked: set[str] = set()
        # A module under two names (os.path, posixpath) is walked once, as the first.
        namespaces: set[int] = set()
        units = 0
        for modname in names:
            if type(modname) is not str or (exclude and modname.startswith(exclude)):
                continue
            try:
                module = modules.get(modname)
                # Not None (a failed import) nor an object standing in for a module.
                ns = _module_dict(module) if issubclass(type(module), types.ModuleType) else None
                module = None
            except Exception:
                continue
            if type(ns) is not dict or id(ns) in namespaces:
                continue
            namespaces.add(id(ns))
            walked.add(modname)
            self._pass_modules += 1
            entry = records.get(modname)
            if entry is None:
                entry = records[modname] = ({}, array("q"))
            here, held = self._module_records, self._module_array = entry
            # Classes are the module's own by the name they were defined in, which an alias of
            # the module does not have.
            owner = ns.get("__name__")
            units = yield from self._walk_namespace(
                ns, owner if type(owner) is str else modname, "", (modname,), True, 2, units)
            ns = None
            # Names of this module not met in this pass are forgotten. The dict changes only
            # here, so its iteration can span slices.
            stale = 0
            for offset in here.values():
                units += 1
                if units >= CHECK_EVERY:
                    units = 0
                    yield
                if held[offset + _SEEN] != p:
                    stale += 1
            if stale:
                kept: dict[str, int] = {}
                compact = array("q")
                for name, offset in here.items():
                    if held[offset + _SEEN] == p:
                        kept[name] = len(compact)
                        compact.extend(held[offset:offset + _WIDTH])
                records[modname] = (kept, compact)
                self._tracked -= stale
            if not records[modname][0]:
                del records[modname]
        # And all those of modules not walked (gone, or failing now).
        for modname in [modname for modname in records if modname not in walked]:
            self._tracked -= len(records.pop(modname)[0])
            units += 1
            if units >= CHECK_EVERY:
                units = 0
                yield
        self._module_records, self._module_array = {}, array("q")
        self._ids, self._kinds, self._skip = set(), {}, set()
        yield from self._rank()
        self._pass += 1

    def _walk_namespace(self, ns: Mapping[str, Any], owner: str, prefix: str,
                        path: tuple[str, ...], classes: bool, depth: int, units: int
                        ) -> Generator[None, None, int]:
        """Containers in `ns` (a module's, a class's or an instance's dict) and below it.

        `owner`: the name the module's classes were defined under; `prefix`: the names that led
        here from the module ("" in the module itself, else ending in "."), and `path` the same
        with the module's name first; `classes`: the classes defined in `owner` found here are
        looked into (a module's namespace); `depth`: how many levels of instances below this one
        are looked into (2 for a module or a class, 1 for an instance found there, 0 one level
        further); `units`: work done since the last yield, returned updated, so that nested
        walks share one count. Only the keys are copied, and no value is held across a yield:
        between slices this holds no container.
        """
        try:
            keys = list(ns)
            get = ns.get
        except Exception:
            return units
        kinds, skip, ids = self._kinds, self._skip, self._ids
        baseline = _REFCOUNT_BASELINE
        # The records of this module, keyed by the names from the module on: the module's own
        # name and the protocol's characters are added to the few that grow only.
        here, held = self._module_records, self._module_array
        p, step = self._round, self._step
        now, before, old, step_now, step_old = self._ring
        value: Any = None
        inner: Any = None
        try:
            for key in keys:
                units += 1
                if units >= CHECK_EVERY:
                    units = 0
                    value = inner = None
                    yield
                    step = self._step  # a new slice, perhaps a new step
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
                    if what == _CONTAINER:
                        n = how(value)  # type: ignore[misc]
                        value = None
                        name = prefix + key
                        r = here.get(name)
                        if r is None or held[r + _SEEN] == p:
                            self._track_new(name, n, r)
                            continue
                        # Inline, as this runs for every container of the program each pass.
                        held[r + _SEEN] = p
                        bits = ((held[r + _BITS] << 1) | (n > held[r + before])) & 15
                        held[r + _BITS] = bits
                        held[r + now] = n
                        held[r + step_now] = step
                        if bits in _THREE_OF_FOUR and n > held[r + old]:
                            self._grows((n - held[r + old]) / max(1, step - held[r + step_old]),
                                        (*path, key), name, n)
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
                units = yield from self._walk_namespace(
                    inner, owner, prefix + key + ".", (*path, key), False,
                    depth if what == _CLASS else depth - 1, units)
                inner = None
                step = self._step
        finally:
            self._objects += len(keys)
        return units

    def _track_new(self, name: str, n: int, offset: Optional[int]) -> None:
        """A container name not met yet in this pass (`offset` None): a new record, if there is
        room for it."""
        if offset is not None:
            return  # two containers under one name: the first met keeps it
        if self._tracked >= self._max_records:
            self._ignored += 1
            return
        step = self._step
        held = self._module_array
        self._module_records[name] = len(held)
        held.extend((self._round, 0, -1, -1, n, n, n, n, n, step, step, step, step, step))
        self._tracked += 1

    def _grows(self, rate: float, path: tuple[str, ...], name: str, n: int) -> None:
        """A grower, gaining `rate` items per step: kept if among the fastest of this pass."""
        qualified = _BAD_CHARS.sub("_", f"{path[0]}.{name}")
        # The tail names the container; the module path in front matters less.
        entry = (rate, qualified[-MAX_NAME:], path, n, name)
        candidates = self._candidates
        if len(candidates) < _MAX_CANDIDATES:
            heapq.heappush(candidates, entry)
        elif entry > candidates[0]:
            heapq.heapreplace(candidates, entry)

    def _rank(self) -> Generator[None, None, None]:
        """Size the growers gaining items fastest, then rank them all by bytes per step."""
        candidates = sorted(self._candidates, reverse=True)
        self._candidates = []
        records = self._records
        sized: dict[tuple[str, ...], dict[str, int]] = {}
        measure = _sizer() if candidates else None
        if measure is not None:
            for _, _, path, _, relative in candidates[:MAX_SIZINGS]:
                yield  # each sizing is a piece of work of its own
                entry = self._size(path, measure)
                if entry is None:
                    continue
                sized[path] = entry
                here, held = records.get(path[0], _NO_RECORDS)
                r = here.get(relative)
                if r is not None and "bytes" in entry and entry.get("items", 0) > 0:
                    held[r + _BYTES] = entry["bytes"]
                    held[r + _BYTES_ITEMS] = entry["items"]
        ranked: list[tuple[tuple[int, float], str, tuple[str, ...], int]] = []
        for rate, name, path, n, relative in candidates:
            here, held = records.get(path[0], _NO_RECORDS)
            r = here.get(relative)
            if r is not None and held[r + _BYTES] >= 0 and held[r + _BYTES_ITEMS] > 0:
                # Bytes per step outrank items per step: the daemon weighs growth in bytes.
                ranked.append(((1, held[r + _BYTES] / held[r + _BYTES_ITEMS] * rate), name,
                               path, n))
            else:
                ranked.append(((0, rate), name, path, n))
        ranked.sort(key=lambda r: r[0], reverse=True)
        growers: dict[str, dict[str, int]] = {}
        for _, name, path, n in ranked:
            if len(growers) >= self._top:
                break
            if name in growers:
                continue  # one name in two modules ("a.b" + "c", "a" + "b.c"): the bigger
            entry = sized.get(path, {})
            growers[name] = {"items": entry.get("items", n),
                             **({"bytes": entry["bytes"]} if "bytes" in entry else {})}
        self._growers = growers

    def _size(self, path: tuple[str, ...], measure: Callable[[Any], dict[str, int]]
              ) -> Optional[dict[str, int]]:
        """Find a container again by the names that led to it, and size it."""
        modules = self._modules if self._modules is not None else sys.modules
        try:
            obj: Any = modules.get(path[0])
            if not issubclass(type(obj), types.ModuleType):
                return None
            for key in path[1:]:
                ns = _namespace(obj)
                if ns is None:
                    return None
                obj = ns.get(key)
            if _classify(type(obj))[0] != _CONTAINER:
                return None
            entry = measure(obj)
        except Exception:
            return None
        if type(entry) is not dict:
            return None
        return {k: v for k, v in entry.items()
                if k in ("items", "bytes") and type(v) is int and v >= 0}
