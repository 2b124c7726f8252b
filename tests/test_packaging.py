"""The release as users get it: an sdist that carries what the README installs and the tests, a
wheel built from that sdist (as `pip install gpuwatch-X.tar.gz` builds one), and that wheel
installed into a fresh virtual environment, where `gpuwatch status` and `gpuwatch demo` run.

Offline by design: the build runs without isolation (setuptools and build come from the test
extra), and the fresh environment gets the wheel with `--no-index --no-deps` plus, on its path,
the installed copies of exactly the distributions the wheel's metadata requires (evaluated for
this interpreter), nothing else. What that proves: the wheel holds the whole program, and its
declared dependencies are enough to run it; PyYAML and bcrypt (the `web` extra) are absent there,
and a web config is refused naming the extra. What it does not prove: that pip resolves those
dependencies from an index (no index is reached).
"""

from __future__ import annotations

import email
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch import __version__
from gpuwatch.simulate.fakenvml import FakeNode

ROOT = Path(__file__).resolve().parent.parent
#: Shipped in the sdist besides the package: what the README and docs tell users to install.
SDIST_MUST_CARRY = (
    "LICENSE", "CHANGELOG.md", "README.md", "Makefile", "Dockerfile", "MANIFEST.in",
    "systemd/gpuwatch.service", "systemd/gpuwatch.sysusers.conf",
    "dashboards/gpuwatch-node.json", "dashboards/gpuwatch-alerts.yml", "dashboards/build.py",
    "deploy/kubernetes/kustomization.yaml", "deploy/kubernetes/daemonset.yaml",
    "deploy/kubernetes/examples/training-pod.yaml", "contrib/slurm/epilog.sh",
    "contrib/slurm/prolog.sh", "docs/kubernetes.md", "docs/json.md", "docs/prometheus.md",
    "tests/conftest.py", "tests/test_packaging.py", "bench/run.py",
)
#: In git but not a file users need from a release.
NOT_SHIPPED = {".gitignore", ".ci/run"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist, then the wheel built from the sdist, both without network."""
    out = tmp_path_factory.mktemp("dist")
    pytest.importorskip("build", reason="the test extra's `build` builds the release")
    # A copy without the checkout's local state (.venv, .run, caches): what a clone has.
    src = tmp_path_factory.mktemp("src") / "gpuwatch"
    tracked = _tracked()
    if tracked is None:
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
            ".venv", ".run", ".git", "__pycache__", "*.egg-info", "build", "dist", ".*_cache"))
    else:
        for name in tracked:
            if (ROOT / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out


def _tracked() -> list[str] | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                          timeout=60)
    if done.returncode != 0:
        return None
    return [n for n in done.stdout.decode().split("\0") if n]


def _sdist(dist: Path) -> Path:
    (one,) = dist.glob("gpuwatch-*.tar.gz")
    return one


def _wheel(dist: Path) -> Path:
    (one,) = dist.glob("gpuwatch-*.whl")
    return one


def test_the_sdist_carries_every_tracked_file_the_unit_dashboards_manifests_docs_and_tests(
        dist: Path) -> None:
    prefix = f"gpuwatch-{__version__}/"
    with tarfile.open(_sdist(dist)) as tar:
        names = {m.name.removeprefix(prefix) for m in tar.getmembers() if m.isfile()}
    missing = [n for n in SDIST_MUST_CARRY if n not in names]
    assert not missing, missing
    tracked = _tracked()
    if tracked is not None:  # a clone: every tracked file but git's own
        assert sorted(set(tracked) - names - NOT_SHIPPED) == []
    assert not [n for n in names if "__pycache__" in n or n.startswith((".venv/", ".run/"))]


def test_the_wheel_is_typed_licensed_and_keeps_yaml_and_bcrypt_in_the_web_extra(
        dist: Path) -> None:
    with zipfile.ZipFile(_wheel(dist)) as whl:
        names = set(whl.namelist())
        info = f"gpuwatch-{__version__}.dist-info"
        metadata = email.message_from_bytes(whl.read(f"{info}/METADATA"))
        license_text = whl.read(f"{info}/licenses/LICENSE").decode()
    assert {"gpuwatch/py.typed", "gpuwatch/document_types.py", "gpuwatch/agent/__init__.py",
            "gpuwatch/simulate/fake_nvml.c", "gpuwatch/agent/bootstrap/sitecustomize.py"} <= names
    assert license_text == (ROOT / "LICENSE").read_text()
    assert metadata["License-Expression"] == "Apache-2.0"
    requires = metadata.get_all("Requires-Dist") or []
    core = [r for r in requires if "extra ==" not in r]
    web = [r for r in requires if 'extra == "web"' in r]
    assert not any(r.lower().startswith(("pyyaml", "bcrypt")) for r in core), core
    assert sorted(r.split(">")[0].lower() for r in web) == ["bcrypt", "pyyaml"]
    assert "web" in (metadata.get_all("Provides-Extra") or [])


def test_the_license_is_the_unmodified_apache_2_0_text() -> None:
    import hashlib

    # The MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt, as license scanners know it.
    digest = hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest()
    assert digest == "3b83ef96387f14655fc854ddc3c6bd57"


def _required(wheel: Path) -> list[str]:
    """The distributions the wheel requires here, without extras, with theirs, recursively."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as whl:
        info = f"gpuwatch-{__version__}.dist-info"
        metadata = email.message_from_bytes(whl.read(f"{info}/METADATA"))
    todo = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    found: list[str] = []
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in found:
            continue
        found.append(req.name.lower())
        todo += [Requirement(r) for r in importlib.metadata.requires(req.name) or []]
    return found


@pytest.fixture(scope="module")
def fresh_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new virtual environment with the wheel installed and the required distributions (the
    installed copies of this interpreter, linked one by one) on its path: nothing more."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           str(_wheel(dist))], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    deps = venv / "deps"
    deps.mkdir()
    for name in _required(_wheel(dist)):
        distribution = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in distribution.files or () if f.parts[0] != ".."}:
            source = Path(str(distribution.locate_file(top)))
            if source.exists() and not (deps / top).exists():
                (deps / top).symlink_to(source)
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "gpuwatch-test-deps.pth").write_text(f"{deps}\n")
    yield venv


def _run(venv: Path, args: list[str], env: dict[str, str], cwd: Path,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "gpuwatch"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_the_installed_wheel_runs_from_its_own_environment_with_only_its_dependencies(
        fresh_venv: Path, tmp_path: Path) -> None:
    python = fresh_venv / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import gpuwatch, sys; print(gpuwatch.__file__); "
                            "import importlib.util as u; "
                            "print(u.find_spec('yaml'), u.find_spec('bcrypt'))"],
                           cwd=tmp_path, capture_output=True, text=True, check=True)
    module, absent = where.stdout.splitlines()
    assert module.startswith(str(fresh_venv)), module
    assert absent == "None None"


def test_gpuwatch_status_from_the_wheel_reads_the_node(
        fresh_venv: Path, fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    done = _run(fresh_venv, ["status"], cli_env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "H100" in done.stdout


def test_gpuwatch_demo_from_the_wheel_tells_its_story_and_ends_clean(
        fresh_venv: Path, tmp_path: Path) -> None:
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    done = _run(fresh_venv, ["demo", "--duration", "20s", "--listen", "127.0.0.1:0"], env,
                tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The daemon from the wheel found job A's orphans and job B's leftovers.
    assert "orphan" in done.stdout and "leftover" in done.stdout, done.stdout[-3000:]


def test_a_web_config_without_the_web_extra_is_refused_naming_the_extra(
        fresh_venv: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users: {}\n")
    done = _run(fresh_venv, ["daemon", "--listen", "127.0.0.1:0", "--web-config", str(web)],
                cli_env, tmp_path)
    assert done.returncode == 78, done.stdout + done.stderr
    assert "pip install 'gpuwatch[web]'" in done.stderr, done.stderr
    assert "bcrypt is not installed" in done.stderr or "yaml is not installed" in done.stderr
