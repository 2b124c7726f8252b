"""A robust test for "this figure grows every step" over a bounded window.

The window (the newest points after warm-up) is cut into 3 or 4 consecutive blocks and each
block is summarised by its median. A leak lifts every block above the one before it. An
allocator's sawtooth does not: blocks that span its cycles have the same median. Nor does a GC
pause or a one-off allocation: a median ignores a spike. Growth that levels off (copy-on-write
pages after a fork, a cache that filled up) shows as a last block no higher than the one before.

Median-of-pairwise-slopes estimators (Theil-Sen) are biased upwards on a sawtooth, whose many
small rises outnumber its few large drops; block medians are not, and cost O(n log n).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional


def median(values: Iterable[float]) -> float:
    """statistics.median, without importing statistics: it brings in decimal and fractions, half
    a MiB of the daemon's resident memory for one function."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        raise ValueError("median of no values")
    middle = n // 2
    return ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True)
class Growth:
    #: Units of y per unit of x (bytes per step, or per second), first block to last.
    slope: float
    #: Share of block-to-block rises that are positive (1.0: every block above the last).
    consistency: float
    #: Slope from the next-to-last block to the last: near 0 once growth levels off.
    recent_slope: float
    #: Smallest rise from one block's median to the next, and the spread of points around
    #: their block's median (median absolute deviation): a rise that noise explains is no rise.
    min_rise: float
    spread: float
    points: int
    first_x: float
    last_x: float
    last_y: float
    #: Slowest rise from one block's lowest point to the next block's, per unit of x: a leak
    #: raises the floor under its noise, a burst of memory held for a step or two (large
    #: batches, garbage a GC frees) raises a block's median, not its floor.
    floor_slope: float = math.inf


def may_grow(xs: Sequence[float], ys: Sequence[float], window: int, min_slope: float) -> bool:
    """A constant-time pre-check: has the series risen at all across the window, at half the
    slope that would matter? Most series (idle, steady) have not, and skip the full test."""
    n = len(xs)
    if n < 2:
        return False
    first = max(0, n - window)
    rise, run = ys[-1] - ys[first], xs[-1] - xs[first]
    # NaN (an unknown figure at either end) compares false: then the full test decides.
    return not (run > 0 and rise < 0.5 * min_slope * run)


def growth(xs: Sequence[float], ys: Sequence[float], after_x: float, window: int,
           min_points: int, *, exact: bool = False) -> Optional[Growth]:
    """The growth of y over the newest `window` points with x >= after_x (NaNs skipped).

    `exact` is for sparse measurements without allocator noise (the agent's discovery passes,
    some steps apart): four points may do, each its own block while there are fewer than six,
    so every one must rise above the one before.
    """
    tail = max(0, len(xs) - 2 * window)  # only the newest points can be in the window
    pts = [(x, y) for x, y in zip(xs[tail:], ys[tail:])
           if x >= after_x and not math.isnan(y)][-window:]
    if len(pts) < max(min_points, 4 if exact else 6):
        return None
    # Three blocks of at least 2 points while the window is short, so a verdict comes early;
    # four once there is enough to keep each block's median robust.
    blocks = 4 if len(pts) >= 16 else 3 if len(pts) >= 6 else len(pts)
    size = len(pts) // blocks
    pts = pts[len(pts) - size * blocks:]
    chunks = [pts[i:i + size] for i in range(0, len(pts), size)]
    medians = [(median(x for x, _ in chunk), median(y for _, y in chunk)) for chunk in chunks]
    spread = median(abs(y - m) for chunk, (_, m) in zip(chunks, medians) for _, y in chunk)
    rises = [(y1 - y0) / (x1 - x0)
             for (x0, y0), (x1, y1) in zip(medians, medians[1:]) if x1 > x0]
    (x_first, y_first), (x_last, y_last) = medians[0], medians[-1]
    if not rises or x_last <= x_first:
        return None
    floors = [(x, min(y for _, y in chunk)) for chunk, (x, _) in zip(chunks, medians)]
    return Growth(
        slope=(y_last - y_first) / (x_last - x_first),
        consistency=sum(r > 0 for r in rises) / len(rises),
        recent_slope=rises[-1],
        min_rise=min(y1 - y0 for (_, y0), (_, y1) in zip(medians, medians[1:])),
        spread=spread,
        points=len(pts),
        first_x=pts[0][0],
        last_x=pts[-1][0],
        last_y=pts[-1][1],
        floor_slope=min(((y1 - y0) / (x1 - x0) if x1 > x0 else -math.inf)
                        for (x0, y0), (x1, y1) in zip(floors, floors[1:])),
    )


def is_growing(g: Optional[Growth], min_slope: float, min_relative: float) -> bool:
    """Growth above both thresholds (absolute, and relative to the current size), every block
    above the one before by more than noise explains, each block's lowest point above the one
    before's at half the least slope that matters (what a burst of memory held for a step or
    two cannot fake, unless it fills a whole block), and not levelling off.

    For a steady trend each rise is about four times the spread within blocks; for noise alone
    about equal to it: twice the spread separates them, three times while blocks are small.
    """
    if g is None or g.slope <= 0:
        return False
    return (g.slope >= min_slope
            and g.slope >= min_relative * max(g.last_y, 0.0)
            and g.consistency == 1.0
            and g.floor_slope >= 0.5 * min_slope
            and g.min_rise > (2 if g.points >= 16 else 2.5) * g.spread
            and g.recent_slope >= 0.5 * g.slope)
