"""How big a buffer is: its items, and the bytes they hold, estimated from a bounded sample.

Sizing never walks a whole container: it reads the sizes of at most 8 items spread over it, of
at most 4 inside each of those (a batch: a tuple or dict of tensors) and of at most 2 one level
further down, so one measurement reads at most 8 x 4 x 2 sizes whatever the container holds.
"""

from __future__ import annotations

import operator
import sys
from collections import deque
from collections.abc import Sequence
from itertools import islice
from typing import Any, Optional

from gpuwatch.protocol import INT_LIMIT as _INT_LIMIT

__all__ = ["SAMPLES", "count", "measure"]

#: Items sampled from a container (spread over it), from each container inside it, and from
#: each container inside those; deeper is unknown.
SAMPLES = (8, 4, 2)

_SCALAR = -1  # a number or None inside a container: holds no buffer memory worth counting
_CONTAINERS = (list, tuple, deque, dict, set, frozenset)
_CONTAINER_TYPES = frozenset(_CONTAINERS)
_BYTES_LIKE = frozenset({bytes, bytearray})
_SCALARS = frozenset({int, float, bool, complex, type(None)})


def count(value: Any) -> Optional[int]:
    """`value` as a protocol integer (0 <= n < 2**63), or None."""
    try:
        n = value if type(value) is int else operator.index(value)
    except Exception:
        return None
    return int(n) if 0 <= n < _INT_LIMIT else None


def measure(obj: Any) -> dict[str, int]:
    """{"items": n, "bytes": b} with whatever is known; {} when the callable or len() failed."""
    entry: dict[str, int] = {}
    try:
        if callable(obj) and not hasattr(obj, "__len__"):
            obj = obj()
            if not hasattr(obj, "__len__") and not isinstance(obj, (bool, float)):
                items = count(obj)
                if items is not None:
                    entry["items"] = items
                    return entry
        if hasattr(obj, "__len__"):
            items = count(len(obj))
            inner = obj
        else:
            qsize = obj.qsize  # queue.Queue and friends: no len(), a qsize() and a .queue inside
            items = count(qsize())
            inner = getattr(obj, "queue", None)
        if items is not None:
            entry["items"] = items
    except Exception:
        return entry
    try:
        size = nbytes(inner, 0)
        if size is not None and size != _SCALAR:
            b = count(size)
            if b is not None:
                entry["bytes"] = b
    except Exception:
        pass  # a container changed under us: items stand, bytes wait for the next report
    return entry


def nbytes(obj: Any, depth: int) -> Optional[int]:
    """Bytes held by `obj`, sampled for containers; None when unknown, _SCALAR for numbers."""
    t = type(obj)
    if t in _BYTES_LIKE:
        return len(obj)
    if t in _SCALARS:
        return _SCALAR
    if t in _CONTAINER_TYPES or isinstance(obj, _CONTAINERS):
        return sampled(obj, depth) if depth < len(SAMPLES) else None
    if t is memoryview:
        return int(obj.nbytes)
    if t is str:
        return sys.getsizeof(obj)
    # numpy arrays, torch tensors (nbytes is the view's own size, not its storage's).
    nbytes = getattr(obj, "nbytes", None)
    if nbytes is not None:
        if callable(nbytes):
            nbytes = nbytes()
        return count(nbytes)
    element_size, nelement = getattr(obj, "element_size", None), getattr(obj, "nelement", None)
    if callable(element_size) and callable(nelement):
        return count(element_size() * nelement())
    return None


def sampled(container: Any, depth: int) -> Optional[int]:
    """Mean size of a bounded sample of the items × their number: never a walk of the whole."""
    n = len(container)
    if n == 0:
        return 0 if depth == 0 else _SCALAR
    k = SAMPLES[depth]
    values = container.values() if isinstance(container, dict) else container
    sample: Sequence[Any]
    if n <= k:
        sample = list(values)
    elif isinstance(container, (list, tuple)):
        stride = n // k
        sample = container[0:stride * k:stride]
    elif isinstance(container, (dict, deque)):
        # No cheap indexing: both ends, so the oldest and the newest items are both seen.
        sample = list(islice(values, k // 2)) + list(islice(reversed(values), k - k // 2))
    else:
        sample = list(islice(values, k))
    if len(sample) > 2 and set(map(type, sample)) <= _BYTES_LIKE:
        return sum(map(len, sample)) * n // len(sample)  # a cache of raw samples, at C speed
    total, sized = 0, False
    # A short tuple or list one level down (a batch: inputs, labels) is summed here as a call to
    # _sampled would sum it: a call per item was half the cost of a report.
    inline = SAMPLES[depth + 1] if depth + 1 < len(SAMPLES) else -1
    for item in sample:
        t = type(item)  # the usual leaves inline: this loop runs up to 16 x 8 times a report
        if t in _BYTES_LIKE:
            total += len(item)
            sized = True
        elif (t is tuple or t is list) and len(item) <= inline:
            for leaf in item:
                lt = type(leaf)
                if lt in _BYTES_LIKE:
                    total += len(leaf)
                    sized = True
                elif lt not in _SCALARS:
                    size = nbytes(leaf, depth + 2)
                    if size is None:
                        return None
                    if size != _SCALAR:
                        total += size
                        sized = True
        elif t not in _SCALARS:
            size = nbytes(item, depth + 1)
            if size is None:
                return None
            if size != _SCALAR:
                total += size
                sized = True
    if not sized:
        return _SCALAR
    return total * n // len(sample)
