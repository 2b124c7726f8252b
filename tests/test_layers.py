"""The layering the package docstrings describe, enforced: the import-linter contracts in
.importlinter (layers, what sinks, detectors, sources and the agent may import, which modules
stand alone) hold for the code as it is, and every known violation they list still exists."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache", "--config", str(ROOT / ".importlinter")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    # A broken contract names the import chain; an ignore that matches nothing any more (the
    # violation was removed) fails as well, so the list of known violations stays true.
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _loaded_by(statement: str) -> dict[str, list[str]]:
    """The gpuwatch modules, and the modules outside the standard library, that a fresh
    interpreter has loaded after `statement`: without site-packages (-S) and PYTHONPATH (-E),
    gpuwatch imported from the checkout, the working directory."""
    probe = (f"import json, sys\n{statement}\n"
             "names = sorted(sys.modules)\n"
             "print(json.dumps({'gpuwatch': [n for n in names if n.split('.')[0] == 'gpuwatch'],"
             " 'other': [n for n in names if n.split('.')[0] not in sys.stdlib_module_names"
             " and n.split('.')[0] not in ('gpuwatch', '__main__')]}))")
    result = subprocess.run([sys.executable, "-E", "-S", "-s", "-c", probe], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, list[str]] = json.loads(result.stdout)
    return loaded


#: What the agent may load of gpuwatch besides itself: the vocabularies it shares.
AGENT_MAY_LOAD = ("gpuwatch", "gpuwatch.protocol", "gpuwatch.launch_env")


def test_the_agent_imported_alone_loads_only_itself_and_the_protocol() -> None:
    loaded = _loaded_by("import gpuwatch.agent")
    outside = [name for name in loaded["gpuwatch"]
               if name not in AGENT_MAY_LOAD and name != "gpuwatch.agent"
               and not name.startswith("gpuwatch.agent.")]
    assert outside == [], outside
    assert "gpuwatch.protocol" in loaded["gpuwatch"]
    assert loaded["other"] == []


@pytest.mark.parametrize("module", ["gpuwatch.protocol", "gpuwatch.launch_env"])
def test_a_shared_vocabulary_imports_nothing_of_gpuwatch(module: str) -> None:
    loaded = _loaded_by(f"import {module}")
    assert loaded["gpuwatch"] == ["gpuwatch", module]
    assert loaded["other"] == []


def _module_names(path: Path) -> set[str]:
    return {target.id for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)}


def test_the_shared_names_are_defined_once() -> None:
    """Neither side keeps a copy: no module of gpuwatch but the two vocabularies gives one of
    their names a value of its own, or spells the socket's name, the runtime directory's
    variable or the job variables the daemon reads."""
    vocabularies = {ROOT / "gpuwatch" / "protocol.py", ROOT / "gpuwatch" / "launch_env.py"}
    names = set().union(*(_module_names(path) for path in vocabularies))
    assert {"PROTOCOL_VERSION", "MAX_DATAGRAM", "MAX_BUFFERS", "SOCKET_NAME", "MAX_TRACE_STEPS",
            "MAX_SEARCH_SECONDS", "WORKER_MARKER_KEYS", "RUN_ID_KEY"} <= names
    literals = {"agent.sock", "agent.d", "GPUWATCH_RUNTIME_DIR", "GPUWATCH_RUN_ID",
                "GPUWATCH_RUN_SUPERVISOR", "TORCHELASTIC_RUN_ID"}
    copies = []
    for path in sorted((ROOT / "gpuwatch").rglob("*.py")):
        if path in vocabularies:
            continue
        tree = ast.parse(path.read_text())
        copies += [f"{path.relative_to(ROOT)}: {name}" for name in _module_names(path) & names]
        copies += [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
                   for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and node.value in literals]
    assert copies == []


#: The most lines a module of gpuwatch may have: past it, a module does more than one job and
#: is split along its seams (docs/layout.md names each module's).
MAX_MODULE_LINES = 600


def test_no_module_of_gpuwatch_is_longer_than_600_lines() -> None:
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for path in (ROOT / "gpuwatch").rglob("*.py")}
    assert len(lengths) > 50  # the package is where it should be
    assert {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}
