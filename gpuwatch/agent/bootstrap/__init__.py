"""The directory to put first on PYTHONPATH for every Python process of a job to load the agent
at start (with GPUWATCH_AGENT=auto): its sitecustomize.py does it. `gpuwatch agent-path` and
`python -m gpuwatch.agent.bootstrap --path` print it."""

from __future__ import annotations

import os


def path() -> str:
    """This directory, absolute."""
    return os.path.dirname(os.path.abspath(__file__))
