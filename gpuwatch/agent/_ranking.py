"""Discovery's ranking: the growers of a pass sized (the fastest few) and ranked by bytes per step.

A grower is found again by the names that led to it and sized by the agent's sampled measure,
which asks the container itself; those never sized are ranked after, by items per step, and a
growing autograd history before every container.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Generator
from typing import Any, Callable, Optional

from gpuwatch.agent._walk import (
    _BYTES,
    _BYTES_ITEMS,
    _CONTAINER,
    _NO_RECORDS,
    Grower,
    ScannerState,
    _classify,
    _namespace,
)
from gpuwatch.protocol import AUTOGRAD_SUFFIX

#: Growers sized per pass, those gaining items fastest first.
MAX_SIZINGS = 16

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


def rank(sc: ScannerState) -> Generator[None, None, None]:
    """Size the growers gaining items fastest, then rank them all by bytes per step: those
    of this pass over the program's own modules, of the library round under way, and of the
    last completed one (where the round under way has not been yet)."""
    merged: dict[tuple[str, ...], Grower] = {}
    current = sc._library_walk
    for group in (sc._library_done, current.candidates if current is not None else [],
                  sc._own_candidates):
        for grower in group:
            merged[grower[2]] = grower
    candidates = sorted(merged.values(), reverse=True)
    sc._own_candidates = []
    records = sc._records
    sized: dict[tuple[str, ...], dict[str, int]] = {}
    measure = _sizer() if candidates else None
    if measure is not None:
        for _, _, path, _, relative, _ in candidates[:MAX_SIZINGS]:
            if relative.endswith(AUTOGRAD_SUFFIX):
                continue  # a tensor's graph: its nodes are its size
            yield  # each sizing is a piece of work of its own
            size = size_grower(sc, path, measure)
            if size is None:
                continue
            size["step"] = sc._step  # sized now: perhaps steps after it was counted
            sized[path] = size
            here, held = records.get(path[0], _NO_RECORDS)
            r = here.get(relative)
            if r is not None and "bytes" in size and size.get("items", 0) > 0:
                held[r + _BYTES] = size["bytes"]
                held[r + _BYTES_ITEMS] = size["items"]
    ranked: list[tuple[tuple[int, float], str, tuple[str, ...], int, int]] = []
    for rate, name, path, n, relative, step in candidates:
        here, held = records.get(path[0], _NO_RECORDS)
        r = here.get(relative)
        if name.endswith(AUTOGRAD_SUFFIX):
            # A growing autograd history is a leak whatever its size: reported first.
            ranked.append(((2, rate), name, path, n, step))
        elif r is not None and held[r + _BYTES] >= 0 and held[r + _BYTES_ITEMS] > 0:
            # Bytes per step outrank items per step: the daemon weighs growth in bytes.
            ranked.append(((1, held[r + _BYTES] / held[r + _BYTES_ITEMS] * rate), name,
                           path, n, step))
        else:
            ranked.append(((0, rate), name, path, n, step))
    ranked.sort(key=lambda r: r[0], reverse=True)
    growers: dict[str, dict[str, int]] = {}
    for _, name, path, n, step in ranked:
        if len(growers) >= sc._top:
            break
        if name in growers:
            continue  # one name in two modules ("a.b" + "c", "a" + "b.c"): the bigger
        size = sized.get(path)
        if size is not None and "items" in size:
            growers[name] = size  # its items, bytes and step, as sized
        else:
            # The step each figure was taken at: a pass spans steps, and the daemon puts the
            # figure at this step, not at the one of the report that carries it.
            growers[name] = {"items": n, **({"bytes": size["bytes"]}
                                            if size is not None and "bytes" in size else {}),
                             "step": step}
    sc._growers = growers


def size_grower(sc: ScannerState, path: tuple[str, ...], measure: Callable[[Any], dict[str, int]]
                ) -> Optional[dict[str, int]]:
    """Find a container again by the names that led to it, and size it."""
    modules = sc._modules if sc._modules is not None else sys.modules
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
