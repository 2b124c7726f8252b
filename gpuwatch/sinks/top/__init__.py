"""`gpuwatch top`: a live, full-screen view of the node, for people who live in htop and nvitop.

feed.py refreshes the documents in a thread of its own (from gpuwatch.sinks.status_source: the
running daemon's, or polls of top's own) and keeps the samples of each process; view.py turns a
document and the interface's state into lines for a terminal of a given size, without curses;
screen.py draws them with curses and reads the keys.
"""

from __future__ import annotations

from gpuwatch.sinks.top.screen import NO_TERMINAL, run_top

__all__ = ["NO_TERMINAL", "run_top"]
