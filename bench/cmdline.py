"""The command line every bench shares: its flags written as keyword defaults, --quick (the
small sizes of a smoke run), --smoke (the smallest sizes: does the bench run and print its
figures, in seconds) and --figures (the JSON file bench/run.py reads its figures from).

    args = arguments(__doc__, quick={"rounds": 2}, rounds=15, gpus=8,
                     interval=(0.5, "seconds between polls"))
    ...
    write_figures(args.figures, {...})
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional


def int_list(text: str) -> list[int]:
    """'8,64,512' -> [8, 64, 512], for flags that take several sizes."""
    return [int(part.replace("_", "")) for part in text.split(",") if part]


def options(doc: Optional[str], **flags: Any) -> argparse.ArgumentParser:
    """A bench's parser: described by the first paragraph of `doc`, a flag for each keyword
    (gpu_procs=64 -> --gpu-procs, an int). A flag takes the type of its default: a bool is off
    unless given, a list takes comma-separated integers ('8,64,512'). A (default, help) pair
    gives the flag its help. Flags of another kind are added to the parser returned."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0] or None)
    for name, default in flags.items():
        default, help_ = default if isinstance(default, tuple) else (default, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=help_)
        else:
            kind = int_list if isinstance(default, list) else type(default)
            parser.add_argument(flag, type=kind, default=default, help=help_)
    return parser


def parse_args(parser: argparse.ArgumentParser, quick: dict[str, Any],
               smoke: Optional[dict[str, Any]] = None) -> argparse.Namespace:
    """The bench's arguments; under --quick, `quick` replaces the full-size defaults, and under
    --smoke (which implies --quick) `smoke` replaces those in turn (flags given on the command
    line still win)."""
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repetitions: a smoke run, not a measurement")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest sizes (implies --quick): checks that the bench runs "
                             "and prints its figures, in seconds; the figures mean nothing")
    parser.add_argument("--figures", type=Path, default=None,
                        help="also write the headline figures here, as JSON (for bench/run.py)")
    args = parser.parse_args()
    if args.quick or args.smoke:
        sizes = {**quick, **(smoke or {})} if args.smoke else quick
        parser.set_defaults(**sizes, quick=True)
        args = parser.parse_args()
    return args


def arguments(doc: Optional[str], quick: dict[str, Any], smoke: Optional[dict[str, Any]] = None,
              **flags: Any) -> argparse.Namespace:
    """options(doc, **flags), parsed with --quick, --smoke and --figures."""
    return parse_args(options(doc, **flags), quick, smoke)


def write_figures(path: Optional[Path], figures: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=1))


def verdict(met: Optional[bool]) -> str:
    """A figure against its goal: met, MISSED, or nothing for a figure without a goal (None)."""
    return "" if met is None else ("met" if met else "MISSED")


def columns(rows: list[tuple[str, ...]], rule: bool = False) -> str:
    """Rows of cells as text, each column as wide as its widest cell; with `rule`, a line of
    dashes under the first row (the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
