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
sequence numbers (`_graphs`), and one whose graph grows is a grower named
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
scratch list cleared each step never qualifies, nor does a registry filled once at import. A
tensor's autograd graph is a grower at every pass it extended the last pass's graph and is larger
than 4 passes ago: its count is exact (the daemon judges the steadiness over its reports). Growers
are ranked by bytes per step (bytes per item, as last sized, times items gained per step; the 16
growers gaining items fastest are sized each pass), those never sized after them by items per
step, and the first `top` (default 8) are reported. At most 100,000 names are tracked, new ones
beyond are ignored; a name not met in a pass is forgotten.

This module schedules the work (the Scanner, its slices, the sorting of modules into the
program's own and the library's); the walk of namespaces and the records it keeps are in `_walk`,
the counting of autograd graphs in `_graphs`, the sizing and ranking of growers in `_ranking`.
Standard library only; nothing from gpuwatch is imported but the protocol's limits and the sizing
function, on first use.
"""

from __future__ import annotations

import os
import sys
import time
import types
from array import array
from collections.abc import Generator, Iterator, Mapping
from typing import Any, Callable, Optional

from gpuwatch.agent._ranking import rank
from gpuwatch.agent._walk import (
    CHECK_EVERY,
    Grower,
    _Kind,
    _module_dict,
    _Walk,
    walk_modules,
)
from gpuwatch.protocol import MAX_DISCOVERED_NAME as MAX_NAME
from gpuwatch.protocol import MAX_DISCOVERED_PER_REPORT

__all__ = ["LIBRARY_SHARE", "MAX_NAME", "MAX_RECORDS", "Scanner", "is_library"]

#: Container names tracked at most; beyond, new names are ignored (and counted).
MAX_RECORDS = 100_000
#: The least share of a slice the library's modules get while there are some to walk.
LIBRARY_SHARE = 0.25


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
        self._own_candidates: list[Grower] = []
        self._library_done: list[Grower] = []
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
        # The training thread's CPU time, not the wall's: on a busy node a slice descheduled
        # half its time still does its budget's work, so a pass takes as many steps as on an
        # idle one (the budget bounds what the agent costs the thread: its CPU).
        clock = time.thread_time
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
        {"items": n, "bytes": b, "step": s}, bytes only where the container was sized in that
        pass, and s the training step its figures were taken at (a pass spans steps)."""
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
        yield from walk_modules(self, walk, own, 0)
        self._own_candidates = walk.candidates
        self._kinds, self._skip = {}, set()
        yield from self._rank()
        self._pass += 1
        self._stats.update(passes=self._pass, candidates=self._tracked,
                           modules_last_pass=walk.modules, objects_last_pass=walk.objects,
                           ignored=self._ignored)
        self._ignored = 0

    def _rank(self) -> Generator[None, None, None]:
        """Size the fastest growers and rank them all (`_ranking`)."""
        return rank(self)

    def _library_round(self) -> Generator[None, None, None]:
        """One round over the library's modules, as the last pass sorted them."""
        walk = self._library_walk = _Walk()
        yield from walk_modules(self, walk, list(self._library_names), 0)
        self._library_done = walk.candidates
        self._library_walk = None
        self._rounds += 1
        self._stats.update(library_rounds=self._rounds, library_modules=walk.modules,
                           library_objects=walk.objects)


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
