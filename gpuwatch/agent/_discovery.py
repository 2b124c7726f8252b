"""Discovery: find the containers of a program that grow, without being told about them.

What is walked, for every loaded module (sys.modules, read anew at each pass, or a given mapping of
names to modules), skipping entries that are not modules and modules whose name starts with one of
`exclude` (by default the agent itself):

- the module's globals (names starting with "__" skipped);
- the class-level attributes of the classes defined in that module;
- the `__dict__` of a long-lived object found there (a module-level or class-level instance, such
  as a client singleton), and the `__dict__` of the objects found in that one: two levels down.

A container is a dict, list, set, deque or bytearray, subclasses included; its items are never
looked into. Where the program has imported torch, a plain torch.Tensor met there that carries
autograd history is followed too: the nodes of its graph are counted, incrementally by torch's
sequence numbers (`_graph_nodes`), and one whose graph grows is a grower named
"<name>:autograd" (protocol.AUTOGRAD_SUFFIX), its nodes as its items, ranked before every
container. Modules, classes (other than the module's own, as above), functions and builtins are
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
import os
import re
import sys
import time
import types
from array import array
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sized
from typing import Any, Callable, Optional, cast

from gpuwatch.protocol import AUTOGRAD_SUFFIX, MAX_DISCOVERED_PER_REPORT
from gpuwatch.protocol import MAX_DISCOVERED_NAME as MAX_NAME

__all__ = ["LIBRARY_SHARE", "MAX_RECORDS", "Scanner", "is_library"]

#: Container names tracked at most; beyond, new names are ignored (and counted).
MAX_RECORDS = 100_000
#: Growers sized per pass, those gaining items fastest first.
MAX_SIZINGS = 16
#: Objects handled between two reads of the clock.
CHECK_EVERY = 64
#: The least share of a slice the library's modules get while there are some to walk.
LIBRARY_SHARE = 0.25
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


#: Autograd graph nodes counted per tensor and pass at most (the first pass: GRAPH_FIRST_BUDGET).
GRAPH_BUDGET = 1024
GRAPH_FIRST_BUDGET = 4096
#: Graph tensors followed at most (names: a root's sequence number and a count each).
MAX_GRAPHS = 256
# AccumulateGrad, a parameter's leaf node, has the largest sequence number (it runs first).
_LEAF_SEQUENCE = 1 << 62


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


def _graph_nodes(root: Any, floor: int, budget: int) -> tuple[int, bool]:
    """The nodes of the autograd graph under `root` numbered above `floor` (every node: -1), at
    most `budget` of them counted; and whether a node numbered `floor` is among their children,
    that is whether this graph extends the one whose root was numbered `floor`. Parameters' leaf
    nodes (AccumulateGrad) are not counted. Each node is asked for its sequence number and its
    next functions, nothing else."""
    count, extends = 0, False
    stack = [root]
    seen = {id(root)}
    met: list[Any] = []
    try:
        while stack and count < budget:
            node = stack.pop()
            count += 1
            # The first input first: `total += loss` keeps the history in its first, so the
            # node numbered `floor` is met within a few nodes, whatever the size of a step's.
            for child, _ in reversed(node.next_functions):
                if child is None or id(child) in seen:
                    continue
                seen.add(id(child))
                met.append(child)  # alive till the count is done: no id is reused meanwhile
                number = child._sequence_nr()
                if number >= _LEAF_SEQUENCE:
                    continue
                if number <= floor:
                    extends = extends or number == floor
                    continue
                stack.append(child)
    except Exception:
        pass
    return count, extends


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


def _stdlib_dirs() -> tuple[str, ...]:
    """Where the standard library's files are: the directory of `os`, and lib/pythonX.Y under
    the base prefixes (a virtual environment's interpreter runs the base installation's), each
    also as its real path."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    dirs = set()
    os_file = getattr(os, "__file__", None)
    if isinstance(os_file, str):
        dirs.add(os.path.dirname(os_file))
    for prefix in {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix}:
        if isinstance(prefix, str) and prefix:
            dirs.add(os.path.join(prefix, "lib", version))
            dirs.add(os.path.join(prefix, "lib64", version))
    found = set()
    for d in dirs:
        for path in (d, os.path.realpath(d)):
            path = path.rstrip(os.sep)
            if path:
                found.add(path + os.sep)
    return tuple(sorted(found, key=len, reverse=True))


_STDLIB_DIRS: Optional[tuple[str, ...]] = None
_THIRD_PARTY_DIRS = tuple(os.sep + d + os.sep for d in ("site-packages", "dist-packages"))
_STDLIB_NAMES = frozenset(sys.builtin_module_names) | frozenset(
    getattr(sys, "stdlib_module_names", ()))


def is_library(name: str, file: Any, parent: Optional[bool] = None) -> bool:
    """Whether module `name`, loaded from `file` (its `__file__`, None where it has none), is
    library code, walked at the lower rate, rather than the program's own, walked every pass.
    `parent`: what this says of the nearest parent package that is loaded, if any.

    Library: a file under a site-packages or dist-packages directory (an installed third-party
    distribution), or under the standard library's directory; without a file, what its parent
    package is (an extension's submodules, such as torch._C._nn, and a package's module objects
    made at run time have none), else a built-in or frozen module of the standard library. The
    program's own: `__main__` always, and every other module: the program's directory,
    PYTHONPATH, a source checkout, an editable install (its files stay in the checkout), a
    namespace package of the program, a module built at run time.
    """
    global _STDLIB_DIRS
    if name == "__main__":
        return False
    if type(file) is str and file:
        if any(d in file for d in _THIRD_PARTY_DIRS):
            return True
        if _STDLIB_DIRS is None:
            _STDLIB_DIRS = _stdlib_dirs()
        return file.startswith(_STDLIB_DIRS)
    if parent is not None:
        return parent
    return name.partition(".")[0] in _STDLIB_NAMES


class _Walk:
    """One walk over a list of modules (the program's own, or the library's), and the module it
    is in: that module's records and its visit number, and the ring slots that visit uses."""

    __slots__ = ("candidates", "held", "here", "ids", "modules", "objects", "ring", "seen")

    def __init__(self) -> None:
        # (items per step, qualified name, path to find it again, length, name in its module):
        # paths, never containers.
        self.candidates: list[tuple[float, str, tuple[str, ...], int, str]] = []
        self.ids: set[int] = set()
        self.modules = self.objects = 0
        self.here: dict[str, int] = {}
        self.held: array[int] = array("q")
        self.seen = 0
        self.ring: tuple[int, ...] = _RINGS[0]


# The ring slots of a module's visit number v (modulo 5): its length now, at the visit before,
# 4 visits before (the slot v + 1 is about to be overwritten), its step now and 4 visits before.
_RINGS = tuple(tuple(r + (v + k) % _RING for r, k in ((_LEN, 0), (_LEN, -1), (_LEN, 1),
                                                       (_STEP, 0), (_STEP, 1)))
               for v in range(_RING))


class Scanner:
    """Finds the growing containers of the modules of a program, a budgeted slice at a time.

    `modules` maps module names to modules (default: sys.modules, read at each pass); `budget` is
    the work of one slice in seconds; `top` the number of growers reported; `exclude` the module
    name prefixes skipped (str.startswith); `max_records` the most container names tracked.

    Two walks share the slices: a pass over the program's own modules (`is_library`), which a
    slice starts or resumes first and which yields the growers, and a round over the library's
    modules, which goes on at its own pace with the rest of each slice, and at least
    LIBRARY_SHARE of it while there is library code to walk.
    """

    # No __dict__: a scanner kept at module level is never walked into, and never finds its own
    # records growing.
    __slots__ = ("_budget", "_exclude", "_graphs", "_growers", "_ignored", "_kinds", "_library",
                 "_library_done", "_library_names", "_library_walk", "_max_records", "_modules",
                 "_names", "_own", "_own_candidates", "_own_names", "_pass", "_records",
                 "_rounds", "_skip", "_spent", "_stats", "_step", "_tiers", "_top", "_tracked",
                 "_visits")

    def __init__(self, modules: Optional[Mapping[str, types.ModuleType]] = None, *,
                 budget: float = 0.002, top: int = MAX_DISCOVERED_PER_REPORT,
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
        # to resize, work that cannot be split; a module's own is small.
        # Per module: each name's offset into one array of the module's records. One array per
        # module, not one object per record: tens of thousands of records would be tracked by
        # the garbage collector, and the allocations of a first pass would set off a full
        # collection of the program's heap inside a slice (100 ms with 2,000 modules loaded).
        self._records: dict[str, tuple[dict[str, int], array[int]]] = {}
        #: Per module: how many times it was walked (its records' rings are indexed by this).
        self._visits: dict[str, int] = {}
        #: Per module name: its __file__ as last seen and whether that makes it library code.
        self._tiers: dict[str, tuple[Any, bool]] = {}
        self._tracked = 0
        self._kinds: dict[type, _Kind] = {}
        self._skip: set[type] = set()  # the types classified _SKIP: most objects, one lookup
        self._own: Optional[Iterator[None]] = None
        self._library: Optional[Iterator[None]] = None
        self._library_walk: Optional[_Walk] = None
        self._library_names: list[str] = []
        self._own_names: list[str] = []
        #: The module names of the last pass that sorted them (None: none yet, or abandoned).
        self._names: Optional[list[str]] = None
        self._own_candidates: list[tuple[float, str, tuple[str, ...], int, str]] = []
        self._library_done: list[tuple[float, str, tuple[str, ...], int, str]] = []
        self._growers: dict[str, dict[str, int]] = {}
        #: Per tensor holding an autograd graph, by qualified name: its root's sequence number,
        #: the graph's nodes counted, and the pass it was last met in (integers only).
        self._graphs: dict[str, tuple[int, int, int]] = {}
        self._pass = self._rounds = 0
        self._step = 0
        self._ignored = 0
        # Work seconds and slices of the pass and of the round under way.
        self._spent = [0.0, 0, 0.0, 0]
        self._stats: dict[str, Any] = {"passes": 0, "candidates": 0, "last_pass_seconds": 0.0,
                                       "slices_last_pass": 0, "modules_last_pass": 0,
                                       "objects_last_pass": 0, "ignored": 0,
                                       "library_rounds": 0, "library_modules": 0,
                                       "library_objects": 0, "library_round_seconds": 0.0,
                                       "library_round_slices": 0}

    # ---- public ----------------------------------------------------------------------------

    def slice(self, step: int, budget: Optional[float] = None) -> bool:
        """Work for about `budget` seconds (default: the scanner's) at training step `step`,
        resuming where the last slice stopped: the pass over the program's own modules first,
        then the round over the library's with what is left, and at least LIBRARY_SHARE of the
        budget while there are library modules. True when this slice completed a pass. Never
        raises, but for KeyboardInterrupt and the like, after which the next slice starts
        afresh."""
        clock = time.perf_counter
        start = clock()
        budget = budget if budget is not None and budget > 0 else self._budget
        deadline = start + budget
        if type(step) is int:
            self._step = step
        spent = self._spent
        own_deadline = deadline - budget * LIBRARY_SHARE if self._library_names else deadline
        try:
            own = self._own
            if own is None:
                own = self._own = self._own_pass()
            done = _advance(own, own_deadline, clock)
            middle = clock()
            spent[0] += middle - start
            spent[1] += 1
            if done:
                self._own = None
                self._stats.update(last_pass_seconds=spent[0], slices_last_pass=spent[1])
                spent[0], spent[1] = 0.0, 0
            if middle < deadline and self._library_names:
                library = self._library
                if library is None:
                    library = self._library = self._library_round()
                if _advance(library, deadline, clock):
                    self._library = None
                spent[2] += clock() - middle
                spent[3] += 1
                if self._library is None:
                    self._stats.update(library_round_seconds=spent[2],
                                       library_round_slices=spent[3])
                    spent[2], spent[3] = 0.0, 0
        except Exception:
            self._abandon()
            return False
        except BaseException:
            self._abandon()
            raise
        return done

    def growers(self) -> dict[str, dict[str, int]]:
        """The growers found by the last completed pass, biggest first: qualified name ->
        {"items": n, "bytes": b}, bytes only where the container was sized in that pass."""
        return {name: dict(entry) for name, entry in self._growers.items()}

    @property
    def stats(self) -> dict[str, Any]:
        """As of the last completed pass: passes (completed), candidates (container names
        tracked), last_pass_seconds (its work time, over its slices), slices_last_pass,
        modules_last_pass and objects_last_pass (the program's own modules walked, and names
        looked at there), ignored (container names not tracked for the bound on records); as
        of the last completed library round: library_rounds (completed), library_modules,
        library_objects, library_round_seconds, library_round_slices."""
        return dict(self._stats)

    # ---- the walks -------------------------------------------------------------------------

    def _abandon(self) -> None:
        # Something unforeseen broke a walk: the next slice starts a pass and a round afresh.
        # Some records took this pass's figures and some not, so all are forgotten: growth is
        # learnt again.
        self._own = self._library = self._library_walk = None
        self._names = None
        self._records, self._visits, self._tracked = {}, {}, 0
        self._own_candidates, self._library_done = [], []
        self._kinds, self._skip = {}, set()
        self._graphs = {}
        self._spent = [0.0, 0, 0.0, 0]

    def _module_dicts(self) -> Mapping[str, Any]:
        return self._modules if self._modules is not None else sys.modules

    def _own_pass(self) -> Generator[None, None, None]:
        """One pass, as a generator that yields every CHECK_EVERY objects for the clock: the
        modules are sorted into the program's own and the library's, the own ones walked, the
        records of modules gone forgotten, and the growers of both walks ranked."""
        # The caches hold types: emptied at each pass, they keep no discarded class alive long.
        self._kinds, self._skip = {}, set()
        modules = self._module_dicts()
        try:
            names = list(modules)
        except Exception:
            names = []
        if names == self._names:
            # The same modules loaded as at the last pass (the usual case, a comparison of
            # interned strings): sorted as then, and no module's records to forget.
            yield from self._own_walk(self._own_names)
            return
        self._names = names
        exclude = self._exclude
        tiers, seen_tiers = self._tiers, {}
        ordered: list[str] = []
        unfiled: list[tuple[str, Any]] = []
        units = 0
        for modname in names:
            units += 1
            if units >= CHECK_EVERY:
                units = 0
                yield
            if type(modname) is not str or (exclude and modname.startswith(exclude)):
                continue
            try:
                module = modules.get(modname)
                # Not None (a failed import) nor an object standing in for a module.
                ns = _module_dict(module) if issubclass(type(module), types.ModuleType) else None
                module = None
                if type(ns) is not dict:
                    continue
                file = ns.get("__file__")
                ns = None
            except Exception:
                continue
            ordered.append(modname)
            tier = tiers.get(modname)
            if tier is not None and tier[0] is file:
                seen_tiers[modname] = tier
            elif type(file) is str and file:
                seen_tiers[modname] = (file, is_library(modname, file))
            else:
                unfiled.append((modname, file))
        # A module without a file is what its nearest loaded parent package is: known only now,
        # as a package can come after its submodules in sys.modules.
        for modname, file in unfiled:
            units += 1
            if units >= CHECK_EVERY:
                units = 0
                yield
            parent: Optional[bool] = None
            above = modname
            while parent is None and "." in above:
                above = above.rpartition(".")[0]
                known = seen_tiers.get(above)
                if known is not None:
                    parent = known[1]
            seen_tiers[modname] = (file, is_library(modname, file, parent))
        own: list[str] = []
        library: list[str] = []
        for modname in ordered:
            (library if seen_tiers[modname][1] else own).append(modname)
        self._tiers = seen_tiers
        self._library_names = library
        self._own_names = own
        # The records and visits of modules no longer loaded go.
        records, visits = self._records, self._visits
        for table in (records, visits):
            for modname in [m for m in table if m not in seen_tiers]:
                del table[modname]
                units += 1
                if units >= CHECK_EVERY:
                    units = 0
                    yield
        tracked = 0
        for here, _ in list(records.values()):
            tracked += len(here)
            units += 1
            if units >= CHECK_EVERY:
                units = 0
                yield
        self._tracked = tracked
        yield from self._own_walk(own)

    def _own_walk(self, own: list[str]) -> Generator[None, None, None]:
        walk = _Walk()
        yield from self._walk_modules(walk, own, 0)
        self._own_candidates = walk.candidates
        self._kinds, self._skip = {}, set()
        yield from self._rank()
        self._pass += 1
        self._stats.update(passes=self._pass, candidates=self._tracked,
                           modules_last_pass=walk.modules, objects_last_pass=walk.objects,
                           ignored=self._ignored)
        self._ignored = 0

    def _library_round(self) -> Generator[None, None, None]:
        """One round over the library's modules, as the last pass sorted them."""
        walk = self._library_walk = _Walk()
        yield from self._walk_modules(walk, list(self._library_names), 0)
        self._library_done = walk.candidates
        self._library_walk = None
        self._rounds += 1
        self._stats.update(library_rounds=self._rounds, library_modules=walk.modules,
                           library_objects=walk.objects)

    def _walk_modules(self, walk: _Walk, names: list[str], units: int
                      ) -> Generator[None, None, int]:
        modules = self._module_dicts()
        records, visits = self._records, self._visits
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
            units = yield from self._walk_namespace(
                walk, ns, owner if type(owner) is str else modname, "", (modname,), True, 2,
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
                self._tracked -= stale
                here = kept
            if not here:
                del records[modname]
        walk.here, walk.held = {}, array("q")
        return units

    def _walk_namespace(self, walk: _Walk, ns: Mapping[str, Any], owner: str, prefix: str,
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
        kinds, skip, ids = self._kinds, self._skip, walk.ids
        baseline = _REFCOUNT_BASELINE
        # The records of this module, keyed by the names from the module on: the module's own
        # name and the protocol's characters are added to the few that grow only.
        here, held = walk.here, walk.held
        p, step = walk.seen, self._step
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
                    if what in (_CONTAINER, _TENSOR):
                        if what == _CONTAINER:
                            n = how(value)  # type: ignore[misc]
                            name = prefix + key
                        else:
                            name = prefix + key + AUTOGRAD_SUFFIX
                            # Held by no local: a graph is never kept across a yield.
                            n, cost = self._graph(f"{path[0]}.{name}",
                                                  how(value))  # type: ignore[misc]
                            value = None
                            units += cost
                            if n < 0:
                                continue
                        value = None
                        r = here.get(name)
                        if r is None or held[r + _SEEN] == p:
                            self._track_new(walk, name, n, r)
                            continue
                        # Inline, as this runs for every container of the program each pass.
                        held[r + _SEEN] = p
                        bits = ((held[r + _BITS] << 1) | (n > held[r + before])) & 15
                        held[r + _BITS] = bits
                        held[r + now] = n
                        held[r + step_now] = step
                        if bits in _THREE_OF_FOUR and n > held[r + old]:
                            self._grows(walk, (n - held[r + old])
                                        / max(1, step - held[r + step_old]),
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
                    walk, inner, owner, prefix + key + ".", (*path, key), False,
                    depth if what == _CLASS else depth - 1, units)
                inner = None
                step = self._step
        finally:
            walk.objects += len(keys)
        return units

    def _graph(self, name: str, grad_fn: Any) -> tuple[int, int]:
        """The nodes of the autograd history a tensor holds (-1: none), and the nodes looked
        at: counted anew where its graph is new, else the nodes added since the last pass
        (those numbered above the root then) added to the count then."""
        graphs = self._graphs
        if grad_fn is None:
            return -1, 1  # no history: nothing to follow
        try:
            root = grad_fn._sequence_nr()
        except Exception:
            return -1, 1
        known = graphs.get(name)
        if known is not None and known[0] == root:
            graphs[name] = (root, known[1], self._pass)
            return known[1], 1
        if known is not None and known[0] < root:
            added, extends = _graph_nodes(grad_fn, known[0], GRAPH_BUDGET)
            total = known[1] + added if extends else added
        else:
            added, _ = _graph_nodes(grad_fn, -1, GRAPH_FIRST_BUDGET)
            total = added
        if known is None and len(graphs) >= MAX_GRAPHS:
            # The ones met longest ago go.
            for old in sorted(graphs, key=lambda k: graphs[k][2])[:MAX_GRAPHS // 4]:
                del graphs[old]
        graphs[name] = (root, total, self._pass)
        return total, added

    def _track_new(self, walk: _Walk, name: str, n: int, offset: Optional[int]) -> None:
        """A container name not met yet in this visit (`offset` None): a new record, if there
        is room for it."""
        if offset is not None:
            return  # two containers under one name: the first met keeps it
        if self._tracked >= self._max_records:
            self._ignored += 1
            return
        step = self._step
        held = walk.held
        walk.here[name] = len(held)
        held.extend((walk.seen, 0, -1, -1, n, n, n, n, n, step, step, step, step, step))
        self._tracked += 1

    def _grows(self, walk: _Walk, rate: float, path: tuple[str, ...], name: str, n: int
               ) -> None:
        """A grower, gaining `rate` items per step: kept if among the fastest of this walk."""
        qualified = _BAD_CHARS.sub("_", f"{path[0]}.{name}")
        # The tail names the container; the module path in front matters less.
        entry = (rate, qualified[-MAX_NAME:], path, n, name)
        candidates = walk.candidates
        if len(candidates) < _MAX_CANDIDATES:
            heapq.heappush(candidates, entry)
        elif entry > candidates[0]:
            heapq.heapreplace(candidates, entry)

    def _rank(self) -> Generator[None, None, None]:
        """Size the growers gaining items fastest, then rank them all by bytes per step: those
        of this pass over the program's own modules, of the library round under way, and of the
        last completed one (where the round under way has not been yet)."""
        merged: dict[tuple[str, ...], tuple[float, str, tuple[str, ...], int, str]] = {}
        current = self._library_walk
        for group in (self._library_done, current.candidates if current is not None else [],
                      self._own_candidates):
            for grower in group:
                merged[grower[2]] = grower
        candidates = sorted(merged.values(), reverse=True)
        self._own_candidates = []
        records = self._records
        sized: dict[tuple[str, ...], dict[str, int]] = {}
        measure = _sizer() if candidates else None
        if measure is not None:
            for _, _, path, _, relative in candidates[:MAX_SIZINGS]:
                if relative.endswith(AUTOGRAD_SUFFIX):
                    continue  # a tensor's graph: its nodes are its size
                yield  # each sizing is a piece of work of its own
                size = self._size(path, measure)
                if size is None:
                    continue
                sized[path] = size
                here, held = records.get(path[0], _NO_RECORDS)
                r = here.get(relative)
                if r is not None and "bytes" in size and size.get("items", 0) > 0:
                    held[r + _BYTES] = size["bytes"]
                    held[r + _BYTES_ITEMS] = size["items"]
        ranked: list[tuple[tuple[int, float], str, tuple[str, ...], int]] = []
        for rate, name, path, n, relative in candidates:
            here, held = records.get(path[0], _NO_RECORDS)
            r = here.get(relative)
            if name.endswith(AUTOGRAD_SUFFIX):
                # A growing autograd history is a leak whatever its size: reported first.
                ranked.append(((2, rate), name, path, n))
            elif r is not None and held[r + _BYTES] >= 0 and held[r + _BYTES_ITEMS] > 0:
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
            size = sized.get(path, {})
            growers[name] = {"items": size.get("items", n),
                             **({"bytes": size["bytes"]} if "bytes" in size else {})}
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


def _advance(work: Iterator[None], deadline: float,
             clock: Callable[[], float]) -> bool:
    """Run `work` piece by piece until `deadline`; True when it has finished."""
    try:
        while True:
            next(work)
            if clock() >= deadline:
                return False
    except StopIteration:
        return True
