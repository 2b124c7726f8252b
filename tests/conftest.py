"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.simulate.fakenvml import FakeNode, build_fake_nvml
from gpuwatch.sources.jobs import RUN_ID_KEY, RUN_SUPERVISOR_KEY


@pytest.fixture(autouse=True, scope="session")
def _outside_any_gpuwatch_run() -> Iterator[None]:
    """The suite may itself run under `gpuwatch run`: the jobs it starts must not inherit that
    job's name and supervisor, or every one of them would be attributed to it."""
    saved = {key: os.environ.pop(key) for key in (RUN_ID_KEY, RUN_SUPERVISOR_KEY)
             if key in os.environ}
    yield
    os.environ.update(saved)


# ---- simulated node (fake NVML driver) -----------------------------------------------------------


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding a freshly built fake libnvidia-ml.so.1 (one build per test session)."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def fake_node(tmp_path: Path, fake_nvml_lib: Path) -> FakeNode:
    """A simulated node with two idle H100s, its state file already written."""
    node = FakeNode(tmp_path / "fake-nvml.state", fake_nvml_lib, gpus=2)
    node.write()
    return node


# ---- the CLI as a user runs it ----------------------------------------------------------------


@pytest.fixture
def cli_env(fake_node: FakeNode, tmp_path: Path) -> dict[str, str]:
    """Environment for running gpuwatch against `fake_node`, with its own runtime dir and no
    system config file, so no test ever talks to a real daemon or reads /etc/gpuwatch."""
    env = fake_node.env()
    env["GPUWATCH_RUNTIME_DIR"] = str(tmp_path / "run")
    env["GPUWATCH_STATE_DIR"] = str(tmp_path / "state")
    env["GPUWATCH_CONFIG"] = "/dev/null"
    env.pop("NOTIFY_SOCKET", None)
    return env
