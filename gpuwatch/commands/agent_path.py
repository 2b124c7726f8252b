"""`gpuwatch agent-path`: the directory that loads the agent into a job's Python processes."""

from __future__ import annotations

import click


@click.command("agent-path", short_help="Print the directory that loads the agent into a job.")
def agent_path() -> None:
    """Print the directory which, first on PYTHONPATH with GPUWATCH_AGENT=auto, has every Python
    process load the agent at start (what `gpuwatch run` does for its job; docs/agent.md has
    recipes for Slurm, Kubernetes and torchrun)."""
    from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR

    click.echo(AGENT_BOOTSTRAP_DIR)
