"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.launch_env import RUN_ID_KEY, RUN_SUPERVISOR_KEY
from gpuwatch.simulate.fakenvml import FakeNode, build_fake_nvml
from gpuwatch.units import plural
from tests import process_guard, worlds

# Before anything is started: every process of this run inherits the tag.
RUN_TAG = process_guard.tag_this_run()
# And computes at one OpenMP thread unless told otherwise, as torchrun starts its workers: the
# suite's PyTorch programs (tiny models, a step every 0.1 s to 2 s) run a few at once on a
# 2-core machine, where each one's pool of threads spinning between two operations burned about
# as much CPU as the programs themselves (tests/test_autograd_history.py, docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _outside_any_gpuwatch_run() -> Iterator[None]:
    """The suite may itself run under `gpuwatch run`: the jobs it starts must not inherit that
    job's name and supervisor, or every one of them would be attributed to it."""
    saved = {key: os.environ.pop(key) for key in (RUN_ID_KEY, RUN_SUPERVISOR_KEY)
             if key in os.environ}
    yield
    os.environ.update(saved)


# ---- progress in a CI log ------------------------------------------------------------------------

#: Modules whose tests run end to end for a minute or more each (a child pytest, a benchmark,
#: a chaos run): each test is named as it starts, so that a log that stays quiet for minutes
#: says on what. `make test` lists the slowest tests at the end too (--durations).
ANNOUNCED_MODULES = frozenset({
    "tests/test_suite_robustness.py", "tests/test_chaos.py", "tests/test_soak.py",
})


# ---- parallel workers, each in a world of its own -----------------------------------------------


def _parallel_in_worlds(config: pytest.Config) -> None:
    """`pytest -n N` (`make test`): each local worker in a PID namespace of its own, with its
    own /proc, where the suite runs as root, and one more worker on the host for the few tests
    that need its kernel threads (tests/worlds.py). Elsewhere the workers share the host."""
    if hasattr(config, "workerinput") or not getattr(config.option, "tx", None):
        return
    if config.option.dist in ("load", "loadgroup"):
        config.option.tx = worlds.worker_specs(list(config.option.tx))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if worlds.HOST_WORKER in "".join(config.option.tx):
        return worlds.make_scheduler(config, log, order=run_order, together=TOGETHER_MODULES)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("host_pids") is not None and worlds.in_own_world():
        pytest.skip("needs the host's PID namespace (its kernel threads): run on the host "
                    f"worker ({worlds.HOST_WORKER}) or without -n")


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    if not getattr(config.option, "numprocesses", None) or config.option.dist == "no":
        return None
    why = worlds.unavailable()
    if why is None:
        return "workers: each in a PID namespace of its own, with its own /proc (tests/worlds.py)"
    return f"workers: sharing this host ({why}); a test may see another worker's processes"


def _worker() -> str:
    """` (worker gw3)` in a worker of pytest-xdist, else nothing: who to ask about a failure.
    (By this run's own config: a pytest that a test runs inherits the variable
    PYTEST_XDIST_WORKER, and is no worker.)"""
    workerinput = getattr(_CONFIG, "workerinput", None)
    return f" (worker {workerinput['workerid']})" if workerinput else ""


# ---- the fast tier ------------------------------------------------------------------------------

#: The end-to-end tests, marked `slow` here and nowhere else: whole modules, and the few tests of
#: an otherwise quick module that start a daemon or flood one. `make test-fast` (pytest -m "not
#: slow") runs everything else, the pure layers, in under a minute; `make test` runs both.
#: docs/testing.md says what each proves (tests/test_docs.py keeps the two lists the same).
SLOW: tuple[str, ...] = (
    "tests/test_agent.py",
    "tests/test_agent_bootstrap.py",
    "tests/test_agent_end_to_end.py",
    "tests/test_alerting_e2e.py",
    "tests/test_authority.py",
    "tests/test_auto_reap.py",
    "tests/test_autograd_history.py",
    "tests/test_bench_smoke.py",
    "tests/test_chaos.py",
    "tests/test_cli_habits.py",
    "tests/test_clock_steps.py",
    "tests/test_culprit_end_to_end.py",
    "tests/test_culprit_seeds.py",
    "tests/test_daemon.py",
    "tests/test_dashboards_e2e.py",
    "tests/test_demo.py",
    "tests/test_detection_scenarios.py",
    "tests/test_doctor.py",
    "tests/test_epilog.py",
    "tests/test_fake_nvml.py",
    "tests/test_gpu_job_program.py",
    "tests/test_hostile_text.py",
    "tests/test_http_server.py",
    "tests/test_job_members.py",
    "tests/test_kubernetes_pods.py",
    "tests/test_narrow_terminals.py",
    "tests/test_nvml_recovery.py",
    "tests/test_packaging.py",
    "tests/test_peer_fidelity.py",
    "tests/test_process_guard.py",
    "tests/test_process_source_vs_psutil.py",
    "tests/test_prometheus_e2e.py",
    "tests/test_python_worker_ticks.py",
    "tests/test_real_launchers.py",
    "tests/test_reap.py",
    "tests/test_reap_audit.py",
    "tests/test_reap_services.py",
    "tests/test_run.py",
    "tests/test_scenario_workloads.py",
    "tests/test_single_daemon.py",
    "tests/test_soak.py",
    "tests/test_status.py",
    "tests/test_suite_robustness.py",
    "tests/test_supervised_jobs.py",
    "tests/test_threat_model.py",
    "tests/test_top.py",
    "tests/test_unreadable_process_list.py",
    "tests/test_web_tls.py",
    "tests/test_worker_memory.py",
    "tests/test_worker_ticks.py",
    "tests/test_worlds.py",
    "tests/gpu",
    "tests/test_agent_budget.py::test_one_users_flood_neither_grows_the_daemon_nor_hides_another_users_leak",
    "tests/test_agent_socket.py::test_a_flood_from_one_user_does_not_starve_another_user_s_reports",
    "tests/test_agent_tracing.py::test_costs_of_tracing_a_step_and_of_the_final_snapshot",
    "tests/test_config_paths.py::test_a_fifo_as_the_config_on_reload_is_refused_and_polls_go_on",
    "tests/test_config_paths.py::test_a_fifo_as_the_web_config_on_reload_is_refused_and_scrapes_go_on",
    "tests/test_docs.py::test_every_metric_family_served_is_documented",
    "tests/test_exposition.py::test_the_daemon_serves_scrapes_between_two_polls_the_same_bytes",
    "tests/test_kubernetes.py::test_the_daemon_runs_and_answers_its_probes_as_root_with_only_the_three_capabilities",
)


def is_slow(nodeid: str) -> bool:
    """Whether SLOW names this test: its module, a folder above it, or the test itself (any of
    its parameters)."""
    path, _, name = nodeid.partition("::")
    function = name.split("[", 1)[0]
    return any(entry in (path, f"{path}::{function}") or path.startswith(entry + "/")
               for entry in SLOW)


#: The modules whose tests keep both cores busy for a minute or more (a chaos run, a soak, the
#: benchmarks, a child test run): under -n they start first, so that the tests that play a story
#: against a deadline (the demo's, top's) run after them rather than starved beside them.
BUSY_MODULES = ANNOUNCED_MODULES | {"tests/test_bench_smoke.py"}


#: The modules whose module-scoped fixture starts a simulated node with its daemon and jobs, or
#: builds the release and a virtual environment from it: under -n all their tests go to one
#: worker, which does that once (a test at a time, each worker that took one did it again).
TOGETHER_MODULES = frozenset({
    "tests/test_hostile_text.py", "tests/test_narrow_terminals.py", "tests/test_packaging.py",
    "tests/test_top.py",
})


def run_order(nodeid: str) -> int:
    """Where a test goes in a parallel run: 0 the busy modules, 1 the other slow tests, 2 the
    rest."""
    if nodeid.split("::", 1)[0] in BUSY_MODULES:
        return 0
    return 1 if is_slow(nodeid) else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if worlds.needs_host_pids(item.nodeid):
            item.add_marker(pytest.mark.host_pids)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, Optional[int], str]) -> None:
    if nodeid.split("::", 1)[0] not in ANNOUNCED_MODULES or _CONFIG is None:
        return
    reporter = _CONFIG.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or reporter.verbosity > 0:
        return  # -v names every test already
    reporter.ensure_newline()
    reporter.write_line(f"{nodeid}: running (a minute or more) ...")


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config
    _parallel_in_worlds(config)


_CONFIG: Optional[pytest.Config] = None


# ---- no process outlives what started it --------------------------------------------------------


def _guard(what: str) -> Iterator[None]:
    before = process_guard.started_by_this_run(RUN_TAG)
    yield
    left = process_guard.left_behind(RUN_TAG, before)
    if left:
        process_guard.end(left)  # so that one leak does not fail the tests after it
        pytest.fail(f"{what}{_worker()} left {plural(len(left), 'process')} running "
                    "(now killed):\n"
                    + "\n".join(f"  {p}" for p in left), pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _nothing_left_by_the_session() -> Iterator[None]:
    """Session-scoped fixtures end what they started."""
    yield from _guard("the test session's fixtures")


@pytest.fixture(autouse=True, scope="module")
def _nothing_left_by_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """Module-scoped fixtures end what they started."""
    yield from _guard(f"the fixtures of {request.module.__name__}")


@pytest.fixture(autouse=True)
def _nothing_left_by_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test (with its function-scoped fixtures) ends every process it started: a process
    left running after it (a grandchild reparented to PID 1 that nobody killed) fails it."""
    yield from _guard(request.node.nodeid)


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
